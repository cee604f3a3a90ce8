"""Small shared test doubles for runtime tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class WordTokenizer:
    """A readable tokenizer for tiny random models: token i is the text "w{i} "; token 0 is EOS."""

    eos_token_ids = frozenset({0})

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"w{i} " for i in ids)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return [i for m in messages for i in self.encode(str(m["content"]))]

    def token_text(self, token_id: int) -> str:
        return f"w{token_id} "
