"""The cost model: per-request and per-step compute / memory time on a model shape and a GPU.

Formulas are DESIGN.md's (the BlendServe paper's): Comp(r) = 2·(p+d)·P / FLOPs,
Mem(r) = (p·d + d²/2)·kv_bytes_per_token / B, ρ = Comp / Mem. Functions take Python numbers or
numpy arrays alike, so the planner can cost a million requests in one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.errors import ProfileError, UnknownNameError
from scheduler.model_shapes import MODEL_SHAPES

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the cost model needs from a decoder: parameter count and KV-cache geometry."""

    name: str
    params: int  # P: all weights (embeddings + layers + lm_head); 2·P FLOPs per token
    layers: int  # L
    hidden: int  # H
    heads: int  # query heads
    kv_heads: int  # KV heads (GQA)
    head_dim: int
    dtype_bytes: int = 2  # KV cache element size (bf16)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 · L · kv_heads · head_dim · bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def named(cls, name: str) -> ModelShape:
        if name not in MODEL_SHAPES:
            known = ", ".join(sorted(MODEL_SHAPES))
            raise UnknownNameError(f"unknown model shape {name!r}; known: {known}")
        return cls.from_hf_config(MODEL_SHAPES[name], name=name)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], *, name: str | None = None) -> ModelShape:
        """Count parameters from a Hugging Face Llama/Qwen2 `config.json` dict."""
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
        bias = bool(config.get("attention_bias", config.get("model_type") == "qwen2"))
        q, kv = heads * head_dim, kv_heads * head_dim
        attn = hidden * q + 2 * hidden * kv + q * hidden + (q + 2 * kv if bias else 0)
        mlp = 3 * hidden * inter
        per_layer = attn + mlp + 2 * hidden  # + two RMSNorm weights
        embed = vocab * hidden
        lm_head = 0 if config.get("tie_word_embeddings", False) else vocab * hidden
        params = embed + layers * per_layer + hidden + lm_head
        dtype = str(config.get("torch_dtype") or "bfloat16")
        return cls(
            name=name or str(config.get("_name_or_path") or config.get("model_type") or "custom"),
            params=params,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
        )


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """Peak dense bf16 FLOP/s, HBM bandwidth, and memory of one accelerator."""

    name: str
    flops: float  # peak dense FLOP/s
    bandwidth: float  # bytes/s
    kv_capacity_bytes: int | None = None  # bytes left for KV; None = derive from memory_bytes
    memory_bytes: int | None = None  # device memory; weights and ~10% workspace come off it
    batch_multiple: int = 128  # preferred token-count multiple for a step (1 on CPUs)

    @classmethod
    def named(cls, name: str) -> HardwareProfile:
        if name not in _PROFILES:
            known = ", ".join(sorted(_PROFILES))
            raise UnknownNameError(f"unknown hardware profile {name!r}; known: {known}")
        return _PROFILES[name]

    @classmethod
    def from_json(cls, path: str | Path) -> HardwareProfile:
        """Read the profile the runtime measured (`{"name", "flops", "bandwidth_bytes_per_s", ...}`)."""
        try:
            data = json.loads(Path(path).read_text())
            flops = float(data["flops"])
            bandwidth = float(data["bandwidth_bytes_per_s"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ProfileError(f"cannot read hardware profile {path}: {exc}") from exc
        if flops <= 0 or bandwidth <= 0:
            raise ProfileError(f"hardware profile {path}: flops and bandwidth must be > 0")
        cap = data.get("kv_capacity_bytes")
        mem = data.get("memory_bytes")
        # A GPU-class device prefers token counts in multiples of 128; a CPU does not care.
        multiple = data.get("batch_multiple") or (128 if flops >= 5e13 else 1)
        return cls(
            name=str(data.get("name", "measured")),
            flops=flops,
            bandwidth=bandwidth,
            kv_capacity_bytes=None if cap is None else int(cap),
            memory_bytes=None if mem is None else int(mem),
            batch_multiple=int(multiple),
        )


_PROFILES: dict[str, HardwareProfile] = {
    "h200": HardwareProfile("h200", flops=989e12, bandwidth=4.8e12, memory_bytes=141_000_000_000),
    "h100": HardwareProfile("h100", flops=989e12, bandwidth=3.35e12, memory_bytes=80_000_000_000),
    "a100": HardwareProfile("a100", flops=312e12, bandwidth=2.039e12, memory_bytes=80_000_000_000),
}

_WORKSPACE_FRACTION = 0.10  # activations, CUDA graphs, allocator slack


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds of compute and memory traffic for requests and steps; see DESIGN.md."""

    shape: ModelShape
    hardware: HardwareProfile

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shape.kv_bytes_per_token

    @property
    def seconds_per_token(self) -> float:
        """Linear-layer compute time of one token: 2·P / FLOPs."""
        return 2.0 * self.shape.params / self.hardware.flops

    @property
    def seconds_per_kv_token(self) -> float:
        """Time to read one token's KV cache once: kv_bytes / B."""
        return self.kv_bytes_per_token / self.hardware.bandwidth

    @property
    def kv_capacity_bytes(self) -> int:
        """KV bytes the device holds: the profile's figure, else memory − weights − workspace."""
        if self.hardware.kv_capacity_bytes is not None:
            return self.hardware.kv_capacity_bytes
        if self.hardware.memory_bytes is None:
            raise ProfileError(f"profile {self.hardware.name!r} has no memory size")
        weights = self.shape.params * self.shape.dtype_bytes
        usable = self.hardware.memory_bytes * (1.0 - _WORKSPACE_FRACTION) - weights
        if usable <= 0:
            raise ProfileError(f"{self.shape.name} does not fit on {self.hardware.name}")
        return int(usable)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_capacity_bytes // self.kv_bytes_per_token

    def comp(self, p: Any, d: Any) -> Any:
        """Compute seconds of a request: every prompt and output token through the linear layers."""
        if _is_array(p, d):
            p = np.asarray(p, dtype=np.float64)
        return (p + d) * self.seconds_per_token

    def mem(self, p: Any, d: Any) -> Any:
        """Memory seconds of a request: decode step i reads p + i tokens of KV, summed over d steps."""
        if _is_array(p, d):
            p = np.asarray(p, dtype=np.float64)
            d = np.asarray(d, dtype=np.float64)
        return (p * d + d * d / 2.0) * self.seconds_per_kv_token

    def rho(self, p: Any, d: Any) -> Any:
        """Density Comp/Mem: > 1 compute-heavy, < 1 memory-heavy; inf when there is no decode."""
        c, m = self.comp(p, d), self.mem(p, d)
        if isinstance(m, np.ndarray):
            with np.errstate(divide="ignore", invalid="ignore"):
                return np.where(m > 0, c / np.where(m > 0, m, 1.0), np.inf)
        return c / m if m > 0 else float("inf")

    def set_rho(self, total_comp: float, total_mem: float, sharing: float) -> float:
        """ρ(R) = (1 − s)·ΣComp / ΣMem for a set with prefix-sharing ratio s."""
        return (1.0 - sharing) * total_comp / total_mem if total_mem > 0 else float("inf")

    def step_compute_time(self, tokens: float) -> float:
        return float(tokens) * self.seconds_per_token

    def step_memory_time(self, kv_tokens_read: float) -> float:
        return float(kv_tokens_read) * self.seconds_per_kv_token

    def step_time(self, tokens: float, kv_tokens_read: float, overlap: bool = True) -> float:
        """One step: compute and memory overlap perfectly (NanoFlow) or run back to back."""
        c, m = self.step_compute_time(tokens), self.step_memory_time(kv_tokens_read)
        return max(c, m) if overlap else c + m

    def optimal_makespan(self, total_comp: float, total_mem: float, max_sharing: float) -> float:
        """T_opt = max((1 − s_max)·ΣComp, ΣMem): every step perfectly balanced, DFS sharing."""
        return max((1.0 - max_sharing) * total_comp, total_mem)

    @classmethod
    def default(cls) -> CostModel:
        """Llama-3-8B on an H200: the profile the project's goals are stated on."""
        return cls(ModelShape.named("llama-3-8b"), HardwareProfile.named("h200"))


def _is_array(*xs: Any) -> bool:
    return any(isinstance(x, np.ndarray) for x in xs)
