"""GGUF conversion: names, Q/K un-permutation, dequantization, metadata, cache behaviour."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from runtime.gguf_convert import (
    SOURCE_FILE,
    convert_gguf,
    hf_tensor_name,
    permute_qk,
    unpermute_qk,
)
from runtime.loader import cached_gguf_folder, default_gguf_path, load_model

torch.set_num_threads(2)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3 * 8, 5)).astype(np.float32)  # 3 heads of dim 8
    b = rng.standard_normal(3 * 8).astype(np.float32)
    assert not np.array_equal(permute_qk(w, 3), w)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(b, 3), 3), b)


def test_llama_cpp_names_map_to_hf_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert (
        hf_tensor_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.1.attn_norm.weight") == "model.layers.1.input_layernorm.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


def test_default_gguf_converts_to_hf_folder_with_its_hyperparameters(
    default_model_dir: Path,
) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (default_model_dir / name).is_file(), name
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
        30,
        576,
        1536,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert (cfg["rope_theta"], cfg["rms_norm_eps"]) == (100000.0, 1e-5)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"]) == (49152, 8192)
    assert cfg["tie_word_embeddings"] is True
    tok_cfg = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["bos_token"] == "<|im_start|>"
    assert "<|im_start|>assistant" in tok_cfg["chat_template"]
    gen = json.loads((default_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


@pytest.mark.slow
def test_conversion_equals_transformers_own_gguf_loader(default_model_dir: Path) -> None:
    """transformers dequantizes and un-permutes independently; every tensor must agree bit for bit."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(default_model_dir))
    theirs = load_gguf_checkpoint(
        str(default_gguf_path()), return_tensors=True, model_to_load=model
    )["tensors"]
    ours = load_file(str(default_model_dir / "model.safetensors"))
    assert set(theirs) == set(ours)
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor.float()), name


# --- a tiny GGUF written here, the way llama.cpp's convert_hf_to_gguf writes one ---------------


def _small_vocab(size: int) -> tuple[list[str], list[int], list[str], str]:
    """The default model's first `size` tokens and the merges among them (the full 49k-token
    vocabulary makes GGUFReader take seconds), plus its chat template."""
    import gguf

    src = gguf.GGUFReader(str(default_gguf_path()))
    tokens = list(src.fields["tokenizer.ggml.tokens"].contents())[:size]
    types = list(src.fields["tokenizer.ggml.token_type"].contents())[:size]
    kept = set(tokens)
    merges = [
        m
        for m in src.fields["tokenizer.ggml.merges"].contents()
        if (parts := m.split(" ", 1))[0] in kept
        and parts[1] in kept
        and parts[0] + parts[1] in kept
    ]
    return tokens, types, merges, src.fields["tokenizer.chat_template"].contents()


def _write_tiny_gguf(path: Path, *, arch: str = "llama") -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF (untied, one Q8_0 tensor) with a cut of the default tokenizer;
    returns the HF-named float32 weights the converter should recover."""
    import gguf

    tokens, types, merges, template = _small_vocab(512)
    rng = np.random.default_rng(1)
    vocab, hidden, heads, kv_heads, ff = len(tokens), 32, 4, 2, 64
    head_dim = hidden // heads
    hf: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)),
        "model.norm.weight": rng.standard_normal(hidden),
        "lm_head.weight": rng.standard_normal((vocab, hidden)),
    }
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(template)
    gguf_tensors: dict[str, np.ndarray] = {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "output_norm.weight": hf["model.norm.weight"],
        "output.weight": hf["lm_head.weight"],
    }
    for i in range(2):
        parts = {
            "attn_norm": ("input_layernorm", (hidden,)),
            "ffn_norm": ("post_attention_layernorm", (hidden,)),
            "attn_q": ("self_attn.q_proj", (heads * head_dim, hidden)),
            "attn_k": ("self_attn.k_proj", (kv_heads * head_dim, hidden)),
            "attn_v": ("self_attn.v_proj", (kv_heads * head_dim, hidden)),
            "attn_output": ("self_attn.o_proj", (hidden, heads * head_dim)),
            "ffn_gate": ("mlp.gate_proj", (ff, hidden)),
            "ffn_up": ("mlp.up_proj", (ff, hidden)),
            "ffn_down": ("mlp.down_proj", (hidden, ff)),
        }
        for g_name, (h_name, shape) in parts.items():
            w = rng.standard_normal(shape)
            hf[f"model.layers.{i}.{h_name}.weight"] = w
            if g_name == "attn_q" and arch == "llama":
                w = permute_qk(w, heads)
            elif g_name == "attn_k" and arch == "llama":
                w = permute_qk(w, kv_heads)
            gguf_tensors[f"blk.{i}.{g_name}.weight"] = w
    for name, w in gguf_tensors.items():
        w = w.astype(np.float32)
        if name == "blk.1.ffn_up.weight":  # one quantized tensor: exercises dequantize
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            hf["model.layers.1.mlp.up_proj.weight"] = gguf.quants.dequantize(
                q, gguf.GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {k: v.astype(np.float32) for k, v in hf.items()}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, _write_tiny_gguf(path)


def test_tiny_gguf_round_trips_to_the_hf_weights(
    tiny_gguf: tuple[Path, dict], tmp_path: Path
) -> None:
    path, expected = tiny_gguf
    folder = convert_gguf(path, tmp_path / "out")
    ours = load_file(str(folder / "model.safetensors"))
    assert set(ours) == set(expected)
    for name, w in expected.items():
        np.testing.assert_array_equal(ours[name].numpy(), w, err_msg=name)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["num_key_value_heads"] == 2


def test_tiny_gguf_logits_equal_transformers_on_the_original_weights(
    tiny_gguf: tuple[Path, dict], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    path, expected = tiny_gguf
    folder = convert_gguf(path, tmp_path / "out")
    converted = AutoModelForCausalLM.from_pretrained(folder).eval()
    reference = LlamaForCausalLM(
        LlamaConfig(**json.loads((folder / "config.json").read_text()))
    ).eval()
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()})
    ids = torch.tensor([[1, 420, 311, 198, 33, 34, 2]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_gguf_path_spec_is_cached_under_its_stem_and_reused(
    tiny_gguf: tuple[Path, dict], tmp_path: Path
) -> None:
    path, _ = tiny_gguf
    model = load_model(str(path), data_dir=tmp_path)
    assert model.name == "tiny-llama"
    folder = tmp_path / "models" / "tiny-llama"
    assert model.path == str(folder)
    before = (folder / "model.safetensors").stat().st_mtime_ns
    again = load_model(str(path), data_dir=tmp_path)
    assert (folder / "model.safetensors").stat().st_mtime_ns == before
    assert again.weights is not None and model.weights is not None
    assert all(torch.equal(again.weights[k], v) for k, v in model.weights.items())


def test_stale_cache_stamp_triggers_reconversion(
    tiny_gguf: tuple[Path, dict], tmp_path: Path
) -> None:
    path, _ = tiny_gguf
    folder = cached_gguf_folder(path, tmp_path, "tiny")
    stamp = json.loads((folder / SOURCE_FILE).read_text())
    (folder / SOURCE_FILE).write_text(json.dumps({**stamp, "converter_version": -1}))
    (folder / "model.safetensors").write_bytes(b"garbage")
    cached_gguf_folder(path, tmp_path, "tiny")
    assert json.loads((folder / SOURCE_FILE).read_text()) == stamp
    assert len(load_file(str(folder / "model.safetensors"))) > 0


def test_failed_conversion_leaves_no_folder_behind(tmp_path: Path) -> None:
    import gguf

    bad = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(bad), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "models"
    with pytest.raises(ValueError, match="unsupported GGUF architecture"):
        convert_gguf(bad, out / "bad")
    assert not out.exists() or list(out.iterdir()) == []


def test_converting_again_keeps_the_folder_a_racing_process_wrote(
    tiny_gguf: tuple[Path, dict], tmp_path: Path
) -> None:
    path, _ = tiny_gguf
    folder = convert_gguf(path, tmp_path / "models" / "tiny")
    inode = (folder / "model.safetensors").stat().st_ino
    convert_gguf(path, folder)  # what a second process that also found no cache does
    assert (folder / "model.safetensors").stat().st_ino == inode
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny"]  # no temp dirs left
