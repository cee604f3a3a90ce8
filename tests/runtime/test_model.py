"""Model forward vs transformers on tiny random configs (Llama, llama3 rope, Qwen2 bias, tied)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from runtime.attention import AttentionBatch, available_backends, make_backend
from runtime.config import ModelConfig
from runtime.errors import UnknownAttentionBackend
from runtime.kv_cache import PagedKVPool
from runtime.model import LlamaModel

TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def hf_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True,
                                             architectures=["Qwen2ForCausalLM"])).eval()
    extra = {"rope_scaling": LLAMA3_ROPE} if kind == "llama3" else {}
    return LlamaForCausalLM(LlamaConfig(**TINY, **extra)).eval()


def ours(hf: torch.nn.Module) -> tuple[LlamaModel, PagedKVPool]:
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    model = LlamaModel(cfg, hf.state_dict())
    pool = PagedKVPool(num_layers=cfg.num_layers, num_pages=64, page_size=4,
                       kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=torch.float32)
    return model, pool


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2"])
def test_chunked_batched_forward_matches_transformers_logits(kind: str) -> None:
    hf = hf_model(kind)
    model, pool = ours(hf)
    cfg = model.config
    if kind == "qwen2":
        assert cfg.attention_bias and cfg.tie_word_embeddings
    attn = make_backend("torch", pool, num_heads=cfg.num_heads, scale=cfg.head_dim**-0.5)
    ids = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits  # [2, 23, V]
    a, b = list(range(6)), list(range(6, 12))  # pages of sequence 0 and 1
    # step 1: first 10 tokens of seq 0, all 23 of seq 1
    batch = AttentionBatch(q_lens=[10, 23], kv_lens=[10, 23], page_tables=[a[:3], b], num_decode=0)
    out = model.forward(torch.cat([ids[0, :10], ids[1]]), torch.cat([torch.arange(10), torch.arange(23)]),
                        attn, attn.plan(batch), torch.arange(33))
    torch.testing.assert_close(out[:10], ref[0, :10], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[10:], ref[1], rtol=1e-4, atol=1e-4)
    # step 2: one decode-like token (seq 0, pos 10) and a chunk after a cached prefix (pos 11..22)
    batch = AttentionBatch(q_lens=[1], kv_lens=[11], page_tables=[a[:3]], num_decode=1)
    out = model.forward(ids[0, 10:11], torch.tensor([10]), attn, attn.plan(batch), torch.arange(1))
    torch.testing.assert_close(out[0], ref[0, 10], rtol=1e-4, atol=1e-4)
    batch = AttentionBatch(q_lens=[12], kv_lens=[23], page_tables=[a], num_decode=0)
    out = model.forward(ids[0, 11:], torch.arange(11, 23), attn, attn.plan(batch), torch.arange(12))
    torch.testing.assert_close(out, ref[0, 11:], rtol=1e-4, atol=1e-4)


def test_llama3_rope_scaling_changes_the_frequencies() -> None:
    from runtime.model import rope_inv_freq

    plain = ModelConfig.from_hf(hf_model("llama").config.to_dict())
    scaled = ModelConfig.from_hf(hf_model("llama3").config.to_dict())
    assert scaled.rope_scaling is not None
    assert not torch.equal(rope_inv_freq(plain), rope_inv_freq(scaled))


def test_random_weights_have_the_config_shapes() -> None:
    cfg = ModelConfig.from_hf(hf_model("llama").config.to_dict())
    model = LlamaModel(cfg, None, dtype=torch.bfloat16)
    assert model.embed.shape == (300, 64) and model.embed.dtype == torch.bfloat16
    assert model.layers[0]["qkv"].shape == ((4 + 2 * 2) * 16, 64)


@pytest.mark.parametrize(("dtype", "gemm"), [(torch.float32, "onednn-packed"),
                                             (torch.bfloat16, "onednn-packed"),
                                             (torch.bfloat16, "bf16-tiles"),
                                             (torch.bfloat16, "amx-tiles")])
def test_prepacked_cpu_weights_give_the_plain_weights_logits(
        dtype: torch.dtype, gemm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.model import pack_cpu_weights

    if not pack_cpu_weights(dtype):
        pytest.skip("this torch build cannot pack linear weights for oneDNN here")
    if gemm == "onednn-packed":
        monkeypatch.setenv("BLENDSERVE_CPU_GEMM", "0")
    torch.manual_seed(0)  # tied embeddings and a qkv bias: both go through the packed path;
    # a vocabulary of 320, every GEMM's width a multiple of 32: the kernel's GEMM takes them
    hf = Qwen2ForCausalLM(Qwen2Config(**{**TINY, "vocab_size": 320}, tie_word_embeddings=True,
                                      architectures=["Qwen2ForCausalLM"])).eval()
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    packed = LlamaModel(cfg, hf.state_dict(), dtype=dtype)
    if packed.gemm != gemm:
        pytest.skip(f"{gemm} GEMMs do not run on this CPU")
    monkeypatch.setenv("BLENDSERVE_PACKED_WEIGHTS", "0")
    plain = LlamaModel(cfg, hf.state_dict(), dtype=dtype)
    assert packed.lm_head is not packed.embed and plain.lm_head is plain.embed
    assert packed.layers[0]["gate_up"].is_mkldnn == (gemm == "onednn-packed")
    assert plain.gemm == "plain" and not plain.layers[0]["gate_up"].is_mkldnn
    outs = []
    for model in (packed, plain):
        pool = PagedKVPool(num_layers=cfg.num_layers, num_pages=16, page_size=4,
                           kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype)
        attn = make_backend("torch", pool, num_heads=cfg.num_heads, scale=cfg.head_dim**-0.5)
        batch = AttentionBatch(q_lens=[9], kv_lens=[9], page_tables=[[0, 1, 2]], num_decode=0)
        ids = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(2))
        outs.append(model.forward(ids, torch.arange(9), attn, attn.plan(batch), torch.arange(9)))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)


def test_a_step_run_in_row_slices_gives_the_whole_steps_logits() -> None:
    """On a CPU a large step's per-row work runs CPU_ROW_CHUNK rows at a time (attention over
    the whole step): the logits are the whole step's, however the slices cut its sequences."""
    hf = hf_model("llama")
    model, pool = ours(hf)
    cfg = model.config
    assert model.row_chunk is not None  # on by default on the CPU
    attn = make_backend("torch", pool, num_heads=cfg.num_heads, scale=cfg.head_dim**-0.5)
    ids = torch.randint(0, 300, (23,), generator=torch.Generator().manual_seed(3))
    batch = AttentionBatch(q_lens=[1, 10, 12], kv_lens=[5, 10, 12],
                           page_tables=[[0, 1], [2, 3, 4], [5, 6, 7]], num_decode=1)
    pos = torch.cat([torch.tensor([4]), torch.arange(10), torch.arange(12)])
    outs = []
    for rows in (None, 4):  # 4 rows: slices cut across the decode and both prompts
        model.row_chunk = rows
        outs.append(model.forward(ids, pos, attn, attn.plan(batch), torch.arange(23)))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_backend_registry_knows_torch_and_rejects_unknown_names() -> None:
    assert "torch" in available_backends()
    pool = PagedKVPool(num_layers=1, num_pages=1, page_size=1, kv_heads=1, head_dim=1,
                       dtype=torch.float32)
    with pytest.raises(UnknownAttentionBackend):
        make_backend("nope", pool, num_heads=1, scale=1.0)


def test_cascade_over_shared_pages_equals_plain_decode_attention() -> None:
    hf = hf_model("llama")
    model, pool = ours(hf)
    cfg = model.config
    attn = make_backend("torch", pool, num_heads=cfg.num_heads, scale=cfg.head_dim**-0.5)
    attn.decode_kernel = None  # the gather path cascades; the kernel reads shared pages per row
    gen = torch.Generator().manual_seed(3)
    pool.data.normal_(generator=gen)  # arbitrary cached K/V
    # three decodes share pages 0-2; the third also shares page 3 with nobody; one stands alone
    tables = [[0, 1, 2, 10, 11], [0, 1, 2, 12], [0, 1, 2, 3, 13], [20, 21]]
    kv_lens = [19, 14, 20, 6]
    batch = AttentionBatch(q_lens=[1] * 4, kv_lens=kv_lens, page_tables=tables, num_decode=4)
    q = torch.randn(4, cfg.num_heads, cfg.head_dim, generator=gen)
    k = torch.randn(4, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    v = torch.randn(4, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    plan = attn.plan(batch)
    assert plan.shared is not None and plan.shared.seqs.tolist() == [0, 1, 2]
    cascaded = attn.forward(0, q, k, v, plan)
    attn.min_shared_pages = 10**9  # plain: every decode gathers its whole context
    plain_plan = attn.plan(batch)
    assert plain_plan.shared is None
    plain = attn.forward(0, q, k, v, plain_plan)
    torch.testing.assert_close(cascaded, plain, rtol=1e-5, atol=1e-5)


def test_decode_length_buckets_equal_one_padded_batch() -> None:
    hf = hf_model("llama")
    model, pool = ours(hf)
    cfg = model.config
    attn = make_backend("torch", pool, num_heads=cfg.num_heads, scale=cfg.head_dim**-0.5)
    attn.decode_kernel = None  # buckets are the gather path's; the kernel reads no padding
    gen = torch.Generator().manual_seed(4)
    pool.data.normal_(generator=gen)
    n = 40  # two buckets of 20, lengths 1..40 tokens
    kv_lens = [1 + (7 * i) % 40 for i in range(n)]
    tables = [list(range(i, i + -(-kl // 4))) for i, kl in enumerate(kv_lens)]  # overlap is fine
    batch = AttentionBatch(q_lens=[1] * n, kv_lens=kv_lens, page_tables=tables, num_decode=n)
    q = torch.randn(n, cfg.num_heads, cfg.head_dim, generator=gen)
    k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    v = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    attn.min_shared_pages = 10**9
    plan = attn.plan(batch)
    assert len(plan.decode) == 2
    bucketed = attn.forward(0, q, k, v, plan)
    attn.decode_buckets = 1
    single = attn.forward(0, q, k, v, attn.plan(batch))
    torch.testing.assert_close(bucketed, single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 64: the 16-lane (AVX-512) or 8-lane (AVX2) path; 24: 8-lane on AVX2; 20: plain loops everywhere
@pytest.mark.parametrize("head_dim", [64, 24, 20], ids=["hd64", "hd24", "hd20"])
# query heads per KV head 1, 3, 4, 5: the bf16 path takes a KV head's rows 3 at a time, 2 where 4
# are left, 1 alone
@pytest.mark.parametrize("heads", [2, 6, 8, 10], ids=["g1", "g3", "g4", "g5"])
def test_in_place_decode_kernel_equals_gathered_sdpa(dtype: torch.dtype, head_dim: int,
                                                     heads: int) -> None:
    """Contexts of 1 token up to several kernel chunks (split and merged), pages scattered."""
    ps, n, kv_heads = 16, 12, 2
    kv_lens = [1, 2, 15, 16, 17, 100, 255, 256, 257, 600, 1000, 31]
    pool = PagedKVPool(num_layers=1, num_pages=256, page_size=ps, kv_heads=kv_heads,
                       head_dim=head_dim, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    pool.data.copy_(torch.randn(pool.data.shape, generator=gen))
    free = torch.randperm(256, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-kl // ps))] for kl in kv_lens]
    batch = AttentionBatch(q_lens=[1] * n, kv_lens=kv_lens, page_tables=tables, num_decode=n)
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    attn = make_backend("torch", pool, num_heads=heads, scale=head_dim**-0.5)
    assert attn.decode_kernel is not None, "the CPU decode kernel did not build here"
    in_place = attn.forward(0, q, k, v, attn.plan(batch))
    attn.decode_kernel = None
    gathered = attn.forward(0, q, k, v, attn.plan(batch))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(in_place.float(), gathered.float(), rtol=tol, atol=tol)


def test_loading_the_decode_kernel_keeps_subnormal_floats() -> None:
    """A library linked with -ffast-math turns on flush-to-zero for the whole process."""
    from runtime.attention import cpu_kernel

    assert cpu_kernel.load() is not None, "the CPU decode kernel did not build here"
    tiny = torch.tensor(1e-40, dtype=torch.float32)  # subnormal in fp32
    assert (tiny * 1.0).item() > 0.0


@pytest.mark.parametrize(("head_dim", "dtype"), [(64, torch.bfloat16), (32, torch.bfloat16),
                                                  (64, torch.float32), (24, torch.float32)])
# query heads per KV head 1, 3, 5: a 32-token block's 32, 96 and 160 rows, 2, 6 and 10 AMX tiles
@pytest.mark.parametrize("heads", [2, 6, 10], ids=["g1", "g3", "g5"])
def test_in_place_prefill_kernel_equals_gathered_masked_sdpa(head_dim: int, dtype: torch.dtype,
                                                             heads: int) -> None:
    """Chunks beside decodes: fresh prompts, chunks over a cached prefix, one-token chunks,
    lengths on and off the 16-token tiles and the 32-token query blocks; pages scattered. bf16
    takes the AMX or AVX512-BF16 tile path where the CPU has one, fp32 (and bf16 elsewhere) the
    generic loops."""
    ps, kv_heads = 16, 2
    pool = PagedKVPool(num_layers=1, num_pages=512, page_size=ps, kv_heads=kv_heads,
                       head_dim=head_dim, dtype=dtype)
    attn = make_backend("torch", pool, num_heads=heads, scale=head_dim**-0.5)
    assert attn.prefill_kernel, "the CPU attention kernel did not build here"
    gen = torch.Generator().manual_seed(6)
    pool.data.copy_(torch.randn(pool.data.shape, generator=gen))
    spec = [(1, 70), (1, 129), (37, 37), (100, 600), (1, 1), (5, 300), (32, 32), (300, 333), (1, 50)]
    free = torch.randperm(512, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-kl // ps))] for _, kl in spec]
    batch = AttentionBatch(q_lens=[q for q, _ in spec], kv_lens=[kl for _, kl in spec],
                           page_tables=tables, num_decode=2)
    tokens = sum(q for q, _ in spec)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
    in_place = attn.forward(0, q, k, v, attn.plan(batch))
    attn.prefill_kernel = False
    gathered = attn.forward(0, q, k, v, attn.plan(batch))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(in_place.float(), gathered.float(), rtol=tol, atol=tol)


def test_fused_bf16_ops_round_as_the_torch_op_chains_do() -> None:
    """RoPE (on an input strided as the qkv GEMM's output slice) and SiLU·up to the bit; the
    RMSNorm too on these inputs (its sum of squares runs in another order than torch's, so on
    some inputs a value rounds the other way)."""
    import torch.nn.functional as F

    from runtime.attention import cpu_kernel
    from runtime.model import _rms_norm, _rope

    lib = cpu_kernel.load()
    assert lib is not None, "the CPU kernel did not build here"
    gen = torch.Generator().manual_seed(7)
    for t in (1, 37):
        x = (torch.randn(t, 96, generator=gen) * 3).to(torch.bfloat16)
        w = torch.randn(96, generator=gen).to(torch.bfloat16)
        assert torch.equal(cpu_kernel.rms_norm(lib, x, w, 1e-5), _rms_norm(x, w, 1e-5))
        qkv = torch.randn(t, 7 * 32, generator=gen).to(torch.bfloat16)
        qk = qkv[:, : 5 * 32].view(t, 5, 32)  # rows 224 apart, heads contiguous
        angle = torch.randint(0, 4000, (t, 1), generator=gen).float() * torch.rand(16, generator=gen)
        cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
        assert torch.equal(cpu_kernel.rope(lib, qk, cos, sin), _rope(qk, cos[:, None], sin[:, None]))
        gu = (torch.randn(t, 2 * 640, generator=gen) * 4).to(torch.bfloat16)
        gate, up = gu.chunk(2, dim=-1)
        assert torch.equal(cpu_kernel.silu_mul(lib, gu), F.silu(gate) * up)


def test_a_bf16_step_with_fused_ops_gives_the_op_chains_logits() -> None:
    hf = hf_model("llama")
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    model = LlamaModel(cfg, hf.state_dict(), dtype=torch.bfloat16)
    assert model.fused_ops is not None, "the CPU kernel did not build here"
    pool = PagedKVPool(num_layers=cfg.num_layers, num_pages=16, page_size=4,
                       kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=torch.bfloat16)
    attn = make_backend("torch", pool, num_heads=cfg.num_heads, scale=cfg.head_dim**-0.5)
    batch = AttentionBatch(q_lens=[9], kv_lens=[9], page_tables=[[0, 1, 2]], num_decode=0)
    ids = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(2))
    outs = []
    for ops in (model.fused_ops, None):
        model.fused_ops = ops
        outs.append(model.forward(ids, torch.arange(9), attn, attn.plan(batch), torch.arange(9)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-2, atol=1e-2)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))


def test_an_amx_cpu_keeps_onednns_gemms_where_the_kernel_was_built_without_amx(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX512-BF16 GEMM is slower than oneDNN's AMX tiles: an AMX CPU takes the kernel's GEMM
    only where the kernel runs it on AMX too."""
    from runtime.attention import cpu_kernel
    from runtime.model import pack_cpu_weights

    if not pack_cpu_weights(torch.bfloat16):
        pytest.skip("this torch build cannot pack linear weights for oneDNN here")
    if cpu_kernel.load() is None:
        pytest.skip("the CPU kernel did not build here")
    monkeypatch.setattr(cpu_kernel, "cpu_has", lambda flag: flag == "amx_bf16")
    monkeypatch.setattr(cpu_kernel, "gemm_kind", lambda lib: "bf16-tiles")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": 320})).eval()
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    assert LlamaModel(cfg, hf.state_dict(), dtype=torch.bfloat16).gemm == "onednn-packed"
    monkeypatch.setattr(cpu_kernel, "gemm_kind", lambda lib: "amx-tiles")
    if cpu_kernel.gemm_supported(cpu_kernel.load(), hf.lm_head.weight.to(torch.bfloat16)):
        assert LlamaModel(cfg, hf.state_dict(), dtype=torch.bfloat16).gemm == "amx-tiles"


def test_the_fused_gate_up_gemm_gives_the_two_passes_bits() -> None:
    """On AMX tiles gate_up's GEMM and SiLU·up run as one pass (cpu_ops.c `gemm_bf16_silu`):
    bit-equal to the GEMM then silu_mul, at every row count and window (rows 1-79, 1,400)."""
    from runtime.attention import cpu_kernel

    lib = cpu_kernel.load()
    assert lib is not None, "the CPU kernel did not build here"
    if cpu_kernel.gemm_kind(lib) != "amx-tiles":
        pytest.skip("no AMX here: gate_up's GEMM and SiLU·up stay two passes")
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(192, 96, generator=gen) * 0.2).to(torch.bfloat16)  # [gate; up], 96 each
    packed = cpu_kernel.pack_weight(lib, w)
    x = torch.randn(1400, 96, generator=gen).to(torch.bfloat16)
    two_passes = cpu_kernel.silu_mul(lib, cpu_kernel.linear(lib, x, packed))
    fused = cpu_kernel.linear_silu(lib, x, packed)
    assert fused is not None and torch.equal(fused, two_passes)
    for m in range(1, 80):
        assert torch.equal(cpu_kernel.linear_silu(lib, x[m:2 * m + 1], packed), two_passes[m:2 * m + 1])
    assert cpu_kernel.linear_silu(lib, x, cpu_kernel.pack_weight(lib, w[:160])) is None  # 80: odd blocks


def test_the_kernel_gemm_is_linear_and_sums_a_row_alone_as_in_any_batch() -> None:
    """cpu_ops.c's bf16 GEMM (AMX tiles or AVX512-BF16): within bf16 rounding of an fp32
    F.linear (bias included), and each row's outputs bit-identical however many rows run with it
    and wherever it sits: 1-79 rows cover every tail of the AVX-512 path's 8-row blocks and of
    the AMX path's 16- and 32-row tiles, 1,400 rows its 1,344-row chunks at k = 96."""
    import torch.nn.functional as F

    from runtime.attention import cpu_kernel

    lib = cpu_kernel.load()
    assert lib is not None, "the CPU kernel did not build here"
    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(96, 96, generator=gen) * 0.1).to(torch.bfloat16)
    if not cpu_kernel.gemm_supported(lib, w):
        pytest.skip("no AVX512-BF16 here: the layers keep oneDNN's GEMMs")
    assert not cpu_kernel.gemm_supported(lib, w[:80])  # widths not a multiple of 32 are refused
    # AMX tiles take k in whole 32-value chunks
    assert cpu_kernel.gemm_supported(lib, w[:, :70]) == (cpu_kernel.gemm_kind(lib) == "bf16-tiles")
    b = torch.randn(96, generator=gen).to(torch.bfloat16)
    packed = cpu_kernel.pack_weight(lib, w)
    x = torch.randn(1400, 96, generator=gen).to(torch.bfloat16)
    out = cpu_kernel.linear(lib, x, packed, b)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()),
                               rtol=1e-2, atol=1e-2)
    for m in range(1, 80):
        assert torch.equal(cpu_kernel.linear(lib, x[:m], packed, b), out[:m])
        assert torch.equal(cpu_kernel.linear(lib, x[m:2 * m + 1], packed, b), out[m:2 * m + 1])
    assert torch.equal(cpu_kernel.linear(lib, x[1343:], packed, b), out[1343:])
    strided = torch.randn(19, 120, generator=gen).to(torch.bfloat16)[:, :96]
    assert torch.equal(cpu_kernel.linear(lib, strided, packed),
                       cpu_kernel.linear(lib, strided.contiguous(), packed))
