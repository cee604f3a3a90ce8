"""GGUF file -> Hugging Face folder: dequantized weights, HF config, fast tokenizer, chat template.

llama.cpp files are quantized and use their own tensor names, keep Q/K rows permuted for their
RoPE kernel, and carry the tokenizer as metadata arrays. The engine and transformers both want a
plain HF folder, so we convert once and cache the folder (see runtime/loader.py); every later load
is a safetensors read. Weights are stored as float32: a dequantized Q4_1/Q8_0 value is
`d * q (+ m)` computed in float32, which bfloat16 would round.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

# Bump when the output of convert_gguf changes, so stale cached folders are rebuilt.
CONVERTER_VERSION = 1
SOURCE_FILE = "blendserve_source.json"  # written into the folder: which GGUF it came from

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# llama.cpp per-layer tensor names -> HF names (suffix .weight / .bias kept).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# Pre-tokenizers of the original HF tokenizers, keyed by GGUF `tokenizer.ggml.pre`.
# SmolLM/StarCoder split every digit apart before GPT-2's byte-level regex.
_BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    },
    "gpt2": _BYTE_LEVEL,
    "default": _BYTE_LEVEL,
}
_PRE_TOKENIZERS["starcoder"] = _PRE_TOKENIZERS["smollm"]
_PRE_TOKENIZERS["refact"] = _PRE_TOKENIZERS["smollm"]

_TOKEN_TYPE_CONTROL = 3  # gguf.TokenType.CONTROL: special tokens (<|im_end|>, ...)
_TOKEN_TYPE_USER_DEFINED = 4  # added, but not special


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's `permute` of q_proj/k_proj rows (convert_hf_to_gguf.LlamaModel.permute).

    llama.cpp interleaves the two rotary halves of every head; HF keeps them as [first half,
    second half]. w: [n_heads * head_dim, in] (a bias is [n_heads * head_dim]).
    """
    rows = w.shape[0]
    # [heads, head_dim/2, 2, ...] -> [heads, 2, head_dim/2, ...]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's forward permutation, kept for the round-trip test of unpermute_qk."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name for a llama.cpp tensor name, or None for tensors HF has no slot for."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        hf = _LAYER_NAMES.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    hf = _GLOBAL_NAMES.get(stem)
    return None if hf is None else f"{hf}.{kind}"


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    """GGUF stores floats as float32; print the shortest decimal (9.99e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def hf_config(reader: Any, *, tied: bool, has_bias: bool) -> dict[str, Any]:
    """config.json for the GGUF's hyperparameters."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(key("vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv") or heads),
        "head_dim": int(key("rope.dimension_count") or hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": tied,
        "attention_bias": has_bias,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    for name in ("bos", "eos", "padding"):
        token_id = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            cfg[f"{'pad' if name == 'padding' else name}_token_id"] = int(token_id)
    return cfg


def dequantized_weights(reader: Any, cfg: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor as float32 in HF layout [out, in] under its HF name, Q/K rows un-permuted."""
    from gguf.quants import dequantize

    permuted = cfg["model_type"] == "llama"  # convert_hf_to_gguf permutes Q/K for llama only
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise ValueError("GGUF with rope_freqs (Llama 3.1 rope scaling) is not supported")
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no Hugging Face equivalent")
        # data: [rows, packed bytes] -> w: [rows, cols] float32 (GGML lists shape as [cols, rows])
        w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(tensor.shape)])
        proj = name.split(".")[-2]
        if permuted and proj in heads:
            w = unpermute_qk(w, int(heads[proj]))
        out[name] = np.array(w, dtype=np.float32, order="C")  # a writable copy, off the mmap
    return out


def _token_content(tokens: list[str], token_id: Any) -> str | None:
    return None if token_id is None or int(token_id) >= len(tokens) else tokens[int(token_id)]


def tokenizer_json(reader: Any) -> dict[str, Any]:
    """A `tokenizers` tokenizer.json equal to the original HF one (byte-level BPE only)."""
    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported GGUF tokenizer (model {model!r}, pre {pre!r}); "
            f"supported: gpt2 with pre in {sorted(_PRE_TOKENIZERS)}"
        )
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [m.split(" ", 1) for m in _field(reader, "tokenizer.ggml.merges", [])]
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": t != _TOKEN_TYPE_CONTROL,
            "special": t == _TOKEN_TYPE_CONTROL,
        }
        for i, (tok, t) in enumerate(zip(tokens, types, strict=True))
        if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZERS[pre],
        "post_processor": {**_BYTE_LEVEL, "trim_offsets": False},
        "decoder": _BYTE_LEVEL,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": merges,
        },
    }


def tokenizer_config(reader: Any, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special token strings and the chat template from GGUF metadata."""
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(cfg["max_position_embeddings"]),
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        content = _token_content(tokens, _field(reader, f"tokenizer.ggml.{key}_token_id"))
        if content is not None:
            out[f"{name}_token"] = content
    template = _field(reader, "tokenizer.chat_template")
    if template:
        out["chat_template"] = str(template)
    return out


def generation_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}


def source_stamp(gguf_path: Path) -> dict[str, Any]:
    """Identifies the GGUF and converter behind a cached folder; a mismatch means reconvert."""
    st = gguf_path.stat()
    return {
        "converter_version": CONVERTER_VERSION,
        "gguf": gguf_path.name,
        "gguf_bytes": st.st_size,
    }


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write the HF folder for `gguf_path` at `out_dir`, atomically; returns out_dir.

    Builds everything in a temporary sibling directory and renames it into place, so a crash
    never leaves a half-written cache and two processes converting at once both end with one
    complete folder (the loser's rename fails and its copy is discarded).
    """
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    reader = GGUFReader(str(gguf_path))
    names = {t.name for t in reader.tensors}
    cfg = hf_config(
        reader, tied="output.weight" not in names, has_bias="blk.0.attn_q.bias" in names
    )
    weights = dequantized_weights(reader, cfg)
    tok_json = tokenizer_json(reader)
    tokenizer = Tokenizer.from_str(json.dumps(tok_json))  # validates before anything is written

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tensors = {k: torch.from_numpy(v) for k, v in weights.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        files = {
            "config.json": cfg,
            "generation_config.json": generation_config(cfg),
            "tokenizer_config.json": tokenizer_config(reader, cfg),
            SOURCE_FILE: source_stamp(gguf_path),
        }
        for fname, obj in files.items():
            (tmp / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp makes it private; the cache is shared
            path.chmod(0o755 if path.is_dir() else 0o644)
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _replace_dir(src: Path, dst: Path) -> None:
    """Move src to dst. A dst with the same source stamp (a racing process finished first) is kept
    and src dropped; a stale dst is moved aside and deleted."""
    if dst.exists():
        stamp = dst / SOURCE_FILE
        if stamp.is_file() and stamp.read_text() == (src / SOURCE_FILE).read_text():
            return
        stale = dst.with_name(f".{dst.name}.stale.{os.getpid()}")
        try:
            dst.rename(stale)
        except OSError:
            return
        shutil.rmtree(stale, ignore_errors=True)
    try:
        src.rename(dst)
    except OSError:
        if not dst.exists():
            raise
