"""HFTokenizer: a Hugging Face fast tokenizer plus chat template, without importing transformers.

Wraps `tokenizers.Tokenizer` (tokenizer.json) and renders the jinja2 chat template the way
transformers' `apply_chat_template` does (same sandbox, filters, globals and special-token
variables), so token ids match transformers exactly while loading in a fraction of a second.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer

# transformers' SPECIAL_TOKENS_ATTRIBUTES: passed to chat templates as variables.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Turn-end markers: when the chat template emits one, generation should stop at it too.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
_CLEANUP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class HFTokenizer:
    """The runtime's Tokenizer (runtime/config.py protocol) over a `tokenizers` fast tokenizer."""

    def __init__(
        self,
        tokenizer: FastTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        # transformers skips this clean-up for BPE models: it would eat real spaces.
        self._clean_up = clean_up_tokenization_spaces and not _is_bpe(tokenizer)
        eos = set(eos_token_ids)
        eos_text = self.special_tokens.get("eos_token")
        if eos_text is not None and (eid := tokenizer.token_to_id(eos_text)) is not None:
            eos.add(eid)
        for marker in _TURN_END_TOKENS:
            mid = tokenizer.token_to_id(marker)
            if chat_template and marker in chat_template and mid is not None:
                eos.add(mid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        """Read tokenizer.json, tokenizer_config.json, chat_template.jinja|json, and the eos ids
        of config.json and generation_config.json from an HF model folder."""
        folder = Path(folder)
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        tokenizer = _fast_tokenizer(folder)
        special = {}
        for name in _SPECIAL_TOKEN_NAMES:
            value = tok_cfg.get(name)
            if isinstance(value, Mapping):  # serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                special[name] = value
        eos: set[int] = set()
        for fname in ("config.json", "generation_config.json"):
            eos.update(_as_ids(_read_json(folder / fname).get("eos_token_id")))
        return cls(
            tokenizer,
            chat_template=_chat_template(folder, tok_cfg),
            special_tokens=special,
            eos_token_ids=eos,
            clean_up_tokenization_spaces=bool(tok_cfg.get("clean_up_tokenization_spaces", False)),
        )

    @property
    def backend(self) -> FastTokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids past the vocabulary (a dummy model's larger vocab) decode to ""."""
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs (special tokens included; a partial UTF-8 byte is "�")."""
        return self.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The chat template's text for `messages` (keys whose value is None are dropped, as
        transformers does, so OpenAI-style `content=None` never renders as "None")."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        return _compile(self.chat_template).render(
            messages=chat,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of the rendered chat with the assistant prompt appended; equals
        transformers' `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`
        (the rendered text is tokenized without adding special tokens, as there)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _is_bpe(tokenizer: FastTokenizer) -> bool:
    return type(tokenizer.model).__name__ == "BPE"


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _fast_tokenizer(folder: Path) -> FastTokenizer:
    """tokenizer.json when present; otherwise let transformers convert a slow tokenizer once."""
    path = folder / "tokenizer.json"
    if path.is_file():
        return FastTokenizer.from_file(str(path))
    from transformers import AutoTokenizer  # slow path: sentencepiece/vocab-only folders

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{folder}: no tokenizer.json and no fast tokenizer conversion")
    return backend


def _chat_template(folder: Path, tok_cfg: Mapping[str, Any]) -> str | None:
    """transformers' order: chat_template.jinja, then chat_template.json, then tokenizer_config."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = _read_json(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """Compile like transformers' `_compile_jinja_template`: immutable sandbox, trim/lstrip blocks,
    loop controls, a json filter that does not escape HTML, raise_exception and strftime_now."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}…{% endgeneration %}` renders its body (transformers tracks it for masks)."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
