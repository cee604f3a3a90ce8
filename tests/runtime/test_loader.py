"""load_model: the default model, HF folders (single file, sharded, Qwen2 biases), dummy shapes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import LoadedModel, ModelConfig
from runtime.loader import DEFAULT_MODEL, load_model
from runtime.tokenizer import HFTokenizer
from scheduler.model_shapes import MODEL_SHAPES

torch.set_num_threads(2)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _save_tiny(
    model: torch.nn.Module, folder: Path, tokenizer_from: Path, **save_kwargs: object
) -> Path:
    model.save_pretrained(folder, **save_kwargs)
    for name in _TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


def _tiny_llama(**overrides: object) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg: dict[str, object] = {
        "vocab_size": 49152,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides})).eval()


def _assert_same_weights(loaded: LoadedModel, model: torch.nn.Module) -> None:
    assert loaded.weights is not None
    expected = {
        k: v for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")
    }
    if loaded.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    assert set(loaded.weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded.weights[name], tensor), name


def test_default_model_loads_with_float32_hf_named_weights(default_model: LoadedModel) -> None:
    assert default_model.name == DEFAULT_MODEL
    cfg = default_model.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    assert default_model.weights is not None
    assert len(default_model.weights) == 2 + 30 * 9  # embed, norm, 9 per layer; lm_head tied
    assert "lm_head.weight" not in default_model.weights
    assert all(
        w.dtype == torch.float32 and w.device.type == "cpu" for w in default_model.weights.values()
    )
    assert 2 in default_model.tokenizer.eos_token_ids


def test_second_load_reads_the_cache_without_reconverting(
    default_model: LoadedModel, default_model_dir: Path, model_data_dir: Path
) -> None:
    stamp = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    again = load_model(DEFAULT_MODEL, data_dir=model_data_dir)
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert again.path == str(default_model_dir)
    assert default_model.weights is not None and again.weights is not None
    assert all(torch.equal(again.weights[k], v) for k, v in default_model.weights.items())


def test_transformers_loads_the_cached_folder_with_the_same_weights(
    default_model: LoadedModel, default_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_dir)
    assert model.config.tie_word_embeddings
    _assert_same_weights(default_model, model)
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert tok.eos_token_id == 2 and len(tok) == 49152


def test_tiny_random_llama_folder_round_trips(default_model_dir: Path, tmp_path: Path) -> None:
    model = _tiny_llama()
    folder = _save_tiny(model, tmp_path / "tiny-llama", default_model_dir)
    loaded = load_model(str(folder), data_dir=tmp_path / "data")
    assert loaded.name == "tiny-llama" and loaded.path == str(folder)
    assert loaded.config == ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert (loaded.config.hidden_size, loaded.config.num_kv_heads) == (32, 2)
    assert not loaded.config.tie_word_embeddings
    _assert_same_weights(loaded, model)
    assert loaded.tokenizer.encode("hello") == HFTokenizer.from_folder(default_model_dir).encode(
        "hello"
    )


def test_tied_tiny_llama_drops_lm_head(default_model_dir: Path, tmp_path: Path) -> None:
    model = _tiny_llama(tie_word_embeddings=True)
    loaded = load_model(
        str(_save_tiny(model, tmp_path / "tied", default_model_dir)), data_dir=tmp_path
    )
    assert loaded.config.tie_word_embeddings
    _assert_same_weights(loaded, model)


def test_sharded_checkpoint_loads_through_its_index(
    default_model_dir: Path, tmp_path: Path
) -> None:
    model = _tiny_llama()
    folder = _save_tiny(model, tmp_path / "sharded", default_model_dir, max_shard_size="2MB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    _assert_same_weights(load_model(str(folder), data_dir=tmp_path), model)


def test_qwen2_folder_keeps_qkv_biases(default_model_dir: Path, tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    loaded = load_model(
        str(_save_tiny(model, tmp_path / "qwen", default_model_dir)), data_dir=tmp_path
    )
    assert loaded.config.architecture == "Qwen2ForCausalLM" and loaded.config.attention_bias
    _assert_same_weights(loaded, model)
    assert loaded.weights is not None and "model.layers.1.self_attn.k_proj.bias" in loaded.weights


def test_float16_checkpoint_is_widened_exactly_to_float32(
    default_model_dir: Path, tmp_path: Path
) -> None:
    model = _tiny_llama().half()
    folder = _save_tiny(model, tmp_path / "half", default_model_dir)
    loaded = load_model(str(folder), data_dir=tmp_path)
    assert loaded.weights is not None
    for name, tensor in model.state_dict().items():
        assert loaded.weights[name].dtype == torch.float32
        assert torch.equal(loaded.weights[name], tensor.float()), name


def test_missing_weight_is_reported_by_name(default_model_dir: Path, tmp_path: Path) -> None:
    folder = _save_tiny(_tiny_llama(), tmp_path / "broken", default_model_dir)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(str(folder), data_dir=tmp_path)


@pytest.mark.parametrize("shape", sorted(MODEL_SHAPES))
def test_dummy_shape_gives_its_config_and_no_weights(shape: str, model_data_dir: Path) -> None:
    loaded = load_model(f"dummy:{shape}", data_dir=model_data_dir)
    assert loaded.name == f"dummy:{shape}"
    assert loaded.config == ModelConfig.from_hf(MODEL_SHAPES[shape])
    assert loaded.weights is None and loaded.path is None
    assert loaded.tokenizer.vocab_size == 49152  # the default model's tokenizer


def test_dummy_tokenizer_decodes_ids_past_its_vocab_to_nothing(model_data_dir: Path) -> None:
    tok = load_model("dummy:llama-3-8b", data_dir=model_data_dir).tokenizer
    hello = tok.encode("Hello")
    assert tok.decode([*hello, 100_000, 128_255]) == "Hello"
    assert tok.token_text(100_000) == ""


def test_unknown_specs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="unknown model"):
        load_model("no-such-model", data_dir=tmp_path)
    with pytest.raises(KeyError, match="unknown model shape"):
        load_model("dummy:gpt-17", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), data_dir=tmp_path)
