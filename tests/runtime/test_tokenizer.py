"""HFTokenizer against transformers on the same folder: ids, text, chat template, eos ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from runtime.config import LoadedModel
from runtime.loader import default_gguf_path
from runtime.tokenizer import HFTokenizer

TEXTS = [
    "Hello, world!",
    "What is 12345 + 678? It's 13023.",
    " leading space and trailing  ",
    "tabs\tand\nnewlines\r\n\n\nand    runs of spaces",
    "naïve café, Ångström, 你好世界, こんにちは, 😀👍🏽",
    "def f(x):\n    return x ** 2  # comment",
    "special <|im_start|>user\nhi<|im_end|> inside text",
    "I'm sure they'll say it's fine, don't you think?",
    "",
]

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1 2 3"},
        {"role": "user", "content": "Now to 5 — in French, s'il vous plaît."},
    ],
    [{"role": "user", "content": "Multi\nline\n\nmessage with <|im_end|> inside", "name": None}],
]


@pytest.fixture(scope="module")
def ours(default_model: LoadedModel) -> HFTokenizer:
    assert isinstance(default_model.tokenizer, HFTokenizer)
    return default_model.tokenizer


@pytest.fixture(scope="module")
def theirs(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def _ids(out: Any) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)."""
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: HFTokenizer, theirs: Any, text: str) -> None:
    assert ours.encode(text) == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False
    )


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(ours: HFTokenizer, theirs: Any, text: str) -> None:
    ids = theirs.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip
        )


def test_digits_are_split_one_per_token_like_the_original_smollm2(ours: HFTokenizer) -> None:
    ids = ours.encode("2024")
    assert [ours.token_text(i) for i in ids] == ["2", "0", "2", "4"]


def test_tokenizer_agrees_with_transformers_own_gguf_tokenizer(ours: HFTokenizer) -> None:
    """transformers rebuilds the tokenizer from the GGUF metadata independently."""
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    ref = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        )


@pytest.mark.parametrize("chat", CHATS)
def test_chat_template_matches_transformers(
    ours: HFTokenizer, theirs: Any, chat: list[dict[str, Any]]
) -> None:
    expected = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert ours.apply_chat_template(chat) == _ids(expected)
    text = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(chat) == text
    assert text.endswith("<|im_start|>assistant\n")


def test_eos_ids_are_im_end(ours: HFTokenizer) -> None:
    assert ours.eos_token_ids == frozenset({2})
    assert ours.token_text(2) == "<|im_end|>"


def test_token_text_keeps_leading_space(ours: HFTokenizer) -> None:
    (token,) = ours.encode(" the")
    assert ours.token_text(token) == " the"


def test_template_with_bos_variable_and_jinja_features_matches_transformers(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """Llama-3-style template: bos_token variable, namespace, tojson, loop controls, raise_exception;
    the turn-end marker it uses becomes an eos id."""
    from transformers import AutoTokenizer

    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{% if m['role'] == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}{{ {'i': ns.n, 'x': '<&>'} | tojson }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(default_model_dir / "tokenizer.json", folder / "tokenizer.json")
    cfg = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    cfg |= {"chat_template": template, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = HFTokenizer.from_folder(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    chat = [
        {"role": "user", "content": "  hi  "},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "yo"},
    ]
    expected = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert ours.apply_chat_template(chat) == _ids(expected)
    assert ours.apply_chat_template(chat)[0] == 0  # bos_token rendered
    assert ours.eos_token_ids == frozenset({0, 2})  # eos_token and the template's <|im_end|>
    with pytest.raises(Exception, match="no tools"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
