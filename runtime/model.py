"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2) over a flat token batch with a paged KV cache.

All sequences' new tokens are concatenated (no padding): forward(input_ids [T], positions [T]).
Weights use Hugging Face Llama names; q/k/v and gate/up are fused into one GEMM each at load.
Numerics follow transformers (RMSNorm in fp32, RoPE cos/sin from fp32 angles) so that greedy
outputs match `generate` token for token in the same dtype.

On a CPU the GEMM weights are reordered once at load into oneDNN's blocked layout and run through
its prepacked linear (`pack_cpu_weights`): on a 2-core EPYC the layers' GEMMs of a step took
1.6-2.2x less time than `F.linear` on the plain tensors in bf16 at 1-64 rows, 1.2x at 512-2048
(2.3-3.5x in fp32). BLENDSERVE_PACKED_WEIGHTS=0 keeps the plain tensors. A one-row input runs
as two rows: oneDNN's one-row kernel sums a row in another order than its many-row kernels (a
1,536-wide down projection came out ~2e-4 of elements a rounding apart), which made a request's
greedy tokens depend on what else ran in its steps (runtime/README.md: batch-invariant). In bf16 the
RMSNorms, RoPE and SiLU·up run as one C pass each (cpu_kernel's elementwise ops, rounding where
the torch op chains they replace round; the norm sums in its own order, see cpu_ops.c);
BLENDSERVE_FUSED_OPS=0 keeps the chains. In bf16 on a CPU with AVX512-BF16 the GEMMs are the
kernel library's own (cpu_ops.c `gemm_bf16`, weights packed for it at load): a row's sums in one
order at any row count. On AMX tiles where the CPU has them (`gemm` = "amx-tiles": oneDNN's AMX
GEMMs change a row's result with the rows beside it; whole decode steps of SmolLM2 in 0.72-0.96x
their time on a 2-core Xeon, prefill steps 0.99-1.02x), else on AVX512-BF16 ("bf16-tiles": decode
steps 0.77-0.94x oneDNN's on a 2-core Zen 5, prefill alike; an AMX CPU whose library lacks AMX
keeps oneDNN's). On AMX tiles gate_up's GEMM also applies SiLU·up before writing (the same bits
as the two passes, steps 0.96-0.99x the time). BLENDSERVE_CPU_GEMM=0 keeps oneDNN's.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from runtime.attention import cpu_kernel
from runtime.attention.base import AttentionBackend
from runtime.config import ModelConfig

log = logging.getLogger(__name__)

LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down")  # the per-layer GEMM weights
# A CPU step's norms, GEMMs and activations run this many rows at a time: a 2,048-row step's
# [rows, 2·intermediate] activations (12 MB for SmolLM2) spill out of cache, and its elementwise
# ops (SiLU, products, the norms' fp32 squares) took 3x the time of four 512-row slices. The
# slices made a long-prompt workload 7% faster on a 2-core EPYC (1,024 and 512 rows alike).
CPU_ROW_CHUNK = 1024
Linear = Callable[..., torch.Tensor]  # (x [T, in], weight, bias=None) -> [T, out]


def _packed_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    if len(x) == 1:  # oneDNN's one-row kernel sums in another order (module docstring)
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), weight, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_cpu_weights(dtype: torch.dtype) -> bool:
    """Whether this CPU build of torch can run linears on pre-packed oneDNN weights in `dtype`
    and gets F.linear's answer doing so (checked once on a small random layer; any failure, or
    BLENDSERVE_PACKED_WEIGHTS=0, keeps the plain tensors)."""
    if os.environ.get("BLENDSERVE_PACKED_WEIGHTS", "1") == "0" or dtype not in (torch.bfloat16, torch.float32):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=gen).to(dtype)
        b = torch.randn(48, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        got = _packed_linear(x, packed, b).float()
    except (AttributeError, RuntimeError) as e:  # no oneDNN, or not for this dtype on this CPU
        log.info("plain linear weights: oneDNN packing unavailable (%s)", e)
        return False
    return bool(torch.allclose(got, F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2))


def _by_rows(rows: list[slice], fn: Callable[..., Any], layer: int, *xs: torch.Tensor) -> Any:
    """fn(layer, *xs) on each slice of rows of xs, the results concatenated (one slice: as is)."""
    if len(rows) == 1:
        return fn(layer, *xs)
    parts = [fn(layer, *(x[r] for x in xs)) for r in rows]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts))
    return torch.cat(parts)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama-3.1 ("llama3") scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    sc = config.rope_scaling
    rope_type = (sc or {}).get("rope_type", (sc or {}).get("type", "default"))
    if sc is None or rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(sc["factor"])
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_ctx = float(sc.get("original_max_position_embeddings", config.max_position_embeddings))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, hidden]; normalised in fp32, rounded to the model dtype, then scaled (as transformers)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; cos/sin: [T, 1, hd/2] -> x rotated (rotate-half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def fused_cpu_ops(device: torch.device, dtype: torch.dtype) -> ctypes.CDLL | None:
    """The CPU kernel library whose fused bf16 elementwise ops the layers use, or None (another
    device or dtype, no compiler, or BLENDSERVE_FUSED_OPS=0). A 64-row decode step had ~12 ms of
    such op chains beside ~30 ms of GEMMs on a 2-core EPYC."""
    if device.type != "cpu" or dtype != torch.bfloat16 or os.environ.get("BLENDSERVE_FUSED_OPS", "1") == "0":
        return None
    return cpu_kernel.load()


class LlamaModel:
    """Weights as plain tensors (no nn.Module): the forward is a straight line of torch ops."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor] | None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        w = (dict(weights) if weights is not None
             else self._random_weights(config, seed, self.device, dtype))

        def get(name: str) -> torch.Tensor:
            return w[name].to(device=self.device, dtype=dtype).contiguous()

        c = config
        self.embed = get("model.embed_tokens.weight")  # [V, hidden]
        if c.tie_word_embeddings or "lm_head.weight" not in w:
            self.lm_head = self.embed
        else:
            self.lm_head = get("lm_head.weight")  # [V, hidden]
        self.norm = get("model.norm.weight")
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer: dict[str, torch.Tensor | None] = {
                "ln1": get(p + "input_layernorm.weight"),
                "ln2": get(p + "post_attention_layernorm.weight"),
                # qkv: [(H + 2*KVH) * hd, hidden]
                "qkv": torch.cat([get(a + f"{n}_proj.weight") for n in "qkv"], 0).contiguous(),
                "qkv_b": None,
                "o": get(a + "o_proj.weight"),  # [hidden, H*hd]
                # gate_up: [2 * inter, hidden]
                "gate_up": torch.cat(
                    [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], 0
                ).contiguous(),
                "down": get(p + "mlp.down_proj.weight"),  # [hidden, inter]
            }
            if c.attention_bias or (a + "q_proj.bias") in w:
                layer["qkv_b"] = torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"], 0)
            self.layers.append(layer)
        self.inv_freq = rope_inv_freq(c).to(self.device)  # [hd/2] fp32
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.linear: Linear = F.linear
        self.gemm = "plain"  # how self.linear runs: plain | onednn-packed | bf16-tiles | amx-tiles
        # CPU: the per-row work of a large step in slices of CPU_ROW_CHUNK rows (see forward)
        self.row_chunk: int | None = CPU_ROW_CHUNK if self.device.type == "cpu" else None
        self.fused_ops = fused_cpu_ops(self.device, dtype)  # None: the torch op chains
        if self.device.type == "cpu" and pack_cpu_weights(dtype):
            self._pack_weights()

    def _pack_weights(self) -> None:
        """The GEMM weights packed once for the kernel library's bf16 GEMM where it takes them
        all, else in oneDNN's layout (see the module docstring); the embedding table stays a
        plain tensor for the lookup, so a tied lm_head gets a packed copy of its own."""
        lib = self.fused_ops
        weights = [self.lm_head, *(lw[n] for lw in self.layers for n in LINEAR_WEIGHTS)]
        kind = cpu_kernel.gemm_kind(lib) if lib is not None else None
        if (lib is not None and kind is not None and os.environ.get("BLENDSERVE_CPU_GEMM", "1") != "0"
                # an AMX CPU whose library was built without AMX: oneDNN's AMX GEMMs are faster
                and (kind == "amx-tiles" or not cpu_kernel.cpu_has("amx_bf16"))
                and all(cpu_kernel.gemm_supported(lib, w) for w in weights)):  # type: ignore[arg-type]
            pack: Callable[[torch.Tensor], torch.Tensor] = partial(cpu_kernel.pack_weight, lib)
            self.linear, self.gemm = partial(cpu_kernel.linear, lib), kind
        else:
            pack = torch.ops.mkldnn._reorder_linear_weight
            self.linear, self.gemm = _packed_linear, "onednn-packed"
        for lw in self.layers:
            for name in LINEAR_WEIGHTS:
                lw[name] = pack(lw[name])  # type: ignore[arg-type]
        self.lm_head = pack(self.lm_head)

    @staticmethod
    def _random_weights(c: ModelConfig, seed: int, device: torch.device,
                        dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Random weights of the right shapes (`dummy:<shape>` models, benchmarks). On a GPU they
        are drawn there in the model dtype: an 8B model's fp32 draw on the host takes minutes."""
        on_host = device.type == "cpu"
        gen = torch.Generator(device=device).manual_seed(seed)
        kw: dict[str, object] = {} if on_host else {"device": device, "dtype": dtype}

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, **kw) * 0.02  # type: ignore[call-overload]

        h, hd = c.hidden_size, c.head_dim
        w = {"model.embed_tokens.weight": rnd(c.vocab_size, h),
             "model.norm.weight": torch.ones(h, **kw)}  # type: ignore[call-overload]
        if not c.tie_word_embeddings:
            w["lm_head.weight"] = rnd(c.vocab_size, h)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            w[p + "input_layernorm.weight"] = torch.ones(h, **kw)  # type: ignore[call-overload]
            w[p + "post_attention_layernorm.weight"] = torch.ones(h, **kw)  # type: ignore[call-overload]
            for n, rows in (("q", c.num_heads * hd), ("k", c.num_kv_heads * hd), ("v", c.num_kv_heads * hd)):
                w[p + f"self_attn.{n}_proj.weight"] = rnd(rows, h)
                if c.attention_bias:
                    w[p + f"self_attn.{n}_proj.bias"] = rnd(rows)
            w[p + "self_attn.o_proj.weight"] = rnd(h, c.num_heads * hd)
            w[p + "mlp.gate_proj.weight"] = rnd(c.intermediate_size, h)
            w[p + "mlp.up_proj.weight"] = rnd(c.intermediate_size, h)
            w[p + "mlp.down_proj.weight"] = rnd(h, c.intermediate_size)
        return w

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, hd/2] in the model dtype, from fp32 angles as transformers computes them."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, hd/2]
        return freqs.cos().to(self.dtype)[:, None, :], freqs.sin().to(self.dtype)[:, None, :]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        plan: object,
        logits_idx: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; logits_idx: [R] rows to project -> logits [R, V] in the
        model dtype (the sampler widens to float32 only the rows that need more than a max)."""
        cos, sin = self.rope(positions)  # [T, 1, hd/2]
        x = self.embed[input_ids]  # [T, hidden]
        # attention takes the whole step; the rest goes row_chunk rows at a time
        t, n = x.shape[0], self.row_chunk or x.shape[0]
        rows = [slice(a, a + n) for a in range(0, t, n)]
        for i in range(len(self.layers)):
            q, k, v = _by_rows(rows, self.layer_pre, i, x, cos, sin)
            x = _by_rows(rows, self.layer_post, i, x, attn.forward(i, q, k, v, plan))
        return self.logits(x, logits_idx)

    # The forward in phases: compute-bound GEMMs (pre, post) around the memory-bound attention,
    # so that runtime/overlap.py can run two nano-batches' phases on two streams.
    def layer_pre(self, i: int, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> q [T, H, hd], k and v [T, KVH, hd] (RoPE applied to q and k)."""
        c, lw, t = self.config, self.layers[i], x.shape[0]
        h = self._norm(x, lw["ln1"])  # type: ignore[arg-type]
        qkv = self.linear(h, lw["qkv"], lw["qkv_b"])  # type: ignore[arg-type]  # [T, (H+2KVH)*hd]
        qk = self._rope(qkv[:, : self.q_size + self.kv_size].view(t, -1, c.head_dim), cos, sin)
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)  # [T, H, hd], [T, KVH, hd]
        v = qkv[:, self.q_size + self.kv_size :].view(t, c.num_kv_heads, c.head_dim)
        return q, k, v

    def layer_post(self, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] residual, o: [T, H*hd] attention output -> the layer's output."""
        lw = self.layers[i]
        x = x + self.linear(o, lw["o"])  # type: ignore[arg-type]
        h = self._norm(x, lw["ln2"])  # type: ignore[arg-type]
        return x + self.linear(self._mlp_act(h, lw["gate_up"]), lw["down"])  # type: ignore[arg-type]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            return cpu_kernel.rms_norm(self.fused_ops, x, weight, self.config.rms_norm_eps)
        return _rms_norm(x, weight, self.config.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            return cpu_kernel.rope(self.fused_ops, x, cos[:, 0], sin[:, 0])
        return _rope(x, cos, sin)

    def _mlp_act(self, h: torch.Tensor, gate_up_w: torch.Tensor) -> torch.Tensor:
        """silu(h · Wgᵀ) · (h · Wuᵀ) [T, inter]: on AMX tiles one pass that never writes the
        [T, 2*inter] sums (the same bits; 0.91-0.94x the two passes' time at 64-1,024 rows)."""
        if self.gemm == "amx-tiles" and self.fused_ops is not None:
            act = cpu_kernel.linear_silu(self.fused_ops, h, gate_up_w)
            if act is not None:
                return act
        return self._silu_mul(self.linear(h, gate_up_w))  # [T, 2*inter] -> [T, inter]

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            return cpu_kernel.silu_mul(self.fused_ops, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def logits(self, x: torch.Tensor, logits_idx: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> logits [R, V] (model dtype) of the rows in logits_idx [R]. Not
        widened here: greedy rows need only a max, and a CPU step's [R, V] float32 copy of
        them cost more than the max itself (64 rows: ~6 ms against ~1.5 ms)."""
        x = self._norm(x.index_select(0, logits_idx), self.norm)
        return self.linear(x, self.lm_head)  # [R, V]
