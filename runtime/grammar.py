"""Grammar-constrained decoding with xgrammar: one compiled grammar per distinct response format,
one matcher per choice, and each step's token masks built together and applied to the logits
before sampling.

Formats compile on first use and stay in an LRU keyed by `ResponseFormat.key` (the schema's
compact JSON), so the lines of a batch that share a schema share one grammar, and a schema that
cannot compile is refused once per key. The mask covers the model's whole logits width: ids past
the tokenizer's vocabulary (padding rows of the LM head) are never allowed. xgrammar (and
transformers, which it imports) load on the first constrained request only.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import torch

from runtime.config import Tokenizer
from runtime.response_format import PARAM
from runtime.schema_prior import typical_json
from runtime.types import RequestError, ResponseFormat

log = logging.getLogger("blendserve.grammar")

MAX_GRAMMARS = 256  # compiled grammars kept; more distinct formats than this recompile
_OBJECT = '{"type":"object"}'  # json_object: any JSON object
_LOOSE_CHARS = r'[^\"\\\r\n]'  # xgrammar's length-bounded string characters (see _json_grammar)
_JSON_CHARS = r'[^\"\\\0-\x1f]'  # what a JSON string may hold unescaped
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[12:00:00] /path/file.cc:42: "


class Grammars:
    """The engine's grammars: compile and check formats, make matchers, mask a step's logits."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits width the masks cover
        self._stop = sorted(stop_ids)
        self._compiler: Any = None
        self._batch: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # key -> CompiledGrammar | RequestError
        self._priors: dict[str, int | None] = {}
        self._mask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, grown as needed

    # ---- formats ----------------------------------------------------------------------------
    def check(self, fmt: ResponseFormat) -> RequestError | None:
        """Why `fmt` cannot constrain decoding (a 400 for its request), or None."""
        got = self._grammar(fmt)
        return got if isinstance(got, RequestError) else None

    def matcher(self, fmt: ResponseFormat) -> Any:
        """A fresh xgrammar GrammarMatcher for one choice of a checked format."""
        import xgrammar as xgr

        got = self._grammar(fmt)
        if isinstance(got, RequestError):  # the engine checks every request before it runs
            raise RuntimeError(f"format was not checked: {got.message}")  # noqa: TRY004
        return xgr.GrammarMatcher(got)

    def prior(self, fmt: ResponseFormat) -> int | None:
        """Output tokens a typical instance of the schema takes (the planner's prior for the
        request); None for `json_object`, which bounds nothing."""
        if fmt.schema is None:
            return None
        if fmt.key not in self._priors:
            text = typical_json(json.loads(fmt.schema))
            if len(self._priors) >= 4 * MAX_GRAMMARS:  # bounded like the grammars themselves
                self._priors.clear()
            self._priors[fmt.key] = len(self._tokenizer.encode(text, add_special_tokens=False)) + 1
        return self._priors[fmt.key]

    def _grammar(self, fmt: ResponseFormat) -> Any:
        key = fmt.key
        got = self._compiled.get(key)
        if got is not None:
            self._compiled.move_to_end(key)
            return got
        compiler = self._get_compiler()
        try:
            got = compiler.compile_grammar(_json_grammar(fmt.schema or _OBJECT))
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/...
            why = _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else
                                  type(exc).__name__)
            got = RequestError(f"Invalid schema for response_format '{fmt.name}': {why}", PARAM,
                               "invalid_value")
        self._compiled[key] = got
        if len(self._compiled) > MAX_GRAMMARS:
            self._compiled.popitem(last=False)
        return got

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = _tokenizer_info(self._tokenizer, self.vocab_size, self._stop)
            threads = max(1, torch.get_num_threads())
            self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        return self._compiler

    # ---- one step ---------------------------------------------------------------------------
    def constrain(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]) -> None:
        """Mask logits [R, V] in place: row rows[i] keeps only what matchers[i] allows next.
        The masks of all rows are filled in one batched call (xgrammar's thread pool)."""
        import xgrammar as xgr

        r, width = logits.shape
        if width != self.vocab_size:
            raise ValueError(f"logits are {width} wide; the grammars cover {self.vocab_size}")
        mask = self._mask_rows(r)
        idx = list(rows)
        self._batch.batch_fill_next_token_bitmask(list(matchers), mask, idx)
        xgr.apply_token_bitmask_inplace(logits, mask[:r], indices=idx)
        dead = [i for i, best in zip(idx, logits[idx].amax(-1).tolist()) if best == float("-inf")]
        for i in dead:  # no token allowed (should not happen): let the choice end on a stop id
            log.warning("a grammar allowed no token; ending the choice")
            logits[i, self._stop[0] if self._stop else 0] = 0.0

    def advance(self, matcher: Any, token: int) -> tuple[bool, bool]:
        """Feed the sampled token; (grammar finished, the token was a stop token).

        Finished means the matcher accepted a stop token, or the output is complete and only a
        stop token could follow (the choice ends without spending a step on it)."""
        if not matcher.accept_token(token):
            log.warning("a grammar refused the token it allowed (%d); ending the choice", token)
            return True, False
        if matcher.is_terminated():
            return True, True
        return (matcher.is_completed() and self._only_stop_next(matcher)), False

    def _only_stop_next(self, matcher: Any) -> bool:
        mask = self._mask_rows(1)
        matcher.fill_next_token_bitmask(mask, 0)
        words = mask[0].numpy().view(np.uint32).copy()
        for t in self._stop:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        return not words.any()

    def _mask_rows(self, rows: int) -> torch.Tensor:
        if self._mask is None or self._mask.shape[0] < rows:
            import xgrammar as xgr

            self._mask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        return self._mask


def _json_grammar(schema: str) -> Any:
    """The schema's grammar: compact JSON (", " and ": "), no properties beyond the schema's.

    xgrammar 0.2.9 writes the characters of a string with minLength/maxLength as
    [^"\\\r\n], which lets raw control characters (a tab, U+001E) into the string: invalid
    JSON. They are excluded here as in its other string rules."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    text = str(grammar)
    if _LOOSE_CHARS in text:
        grammar = xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS))
    return grammar


def _tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop: list[int]) -> Any:
    """xgrammar's view of the vocabulary: an HF fast tokenizer when there is one (byte-level
    BPE, SentencePiece, …, detected by xgrammar), else each id's decoded text."""
    import xgrammar as xgr

    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=backend)
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                  stop_token_ids=stop or None)
    vocab = [tokenizer.decode([i]) for i in range(min(tokenizer.vocab_size, vocab_size))]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=stop or None)
