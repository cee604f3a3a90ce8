"""The cost model: per-request and per-step compute / memory time of a model on a device.

Formulas are DESIGN.md's (the BlendServe paper's): Comp(r) = 2·(p+d)·P / FLOPs (+ prefill
attention), Mem(r) = (p·d + d²/2)·kv_bytes_per_token / B, ρ = Comp / Mem, and one step-time
model, t = W + combine(T_comp, T_mem), for planner and simulator alike. The coefficients come
from datasheet peaks or, for the device the engine runs on, from `blendserve profile`'s fit.
Functions take Python numbers or numpy arrays alike, so the planner can cost a million requests
in one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
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
class StepCoefficients:
    """A step-time model fitted on the served model and device (`blendserve profile`).

    t_step = step_fixed_s + combine(compute, memory), where
    compute = tokens·s_per_token + rows·s_per_row + pairs·s_per_pair (+ sampled rows and first
    KV writes, below) and memory = (kv − shared)·s_per_kv_token + shared·s_per_shared_kv_token.
    """

    step_fixed_s: float  # W: weights read once per step, launch and host (Python) overhead
    s_per_token: float  # every token through the linear layers
    s_per_row: float  # every sampled row: the LM head over the vocabulary, and sampling
    s_per_pair: float  # prefill attention, per (query, key) pair
    s_per_kv_token: float  # decode attention, per cached token read
    # a KV slot's first write on a page the process never used (the OS backs it then): on a
    # CPU, per KV token written to a fresh page; 0 where memory is allocated up front (GPUs)
    s_per_fresh_kv_token: float = 0.0
    # decode attention, per KV token another decode of the step reads too (a shared prompt
    # prefix: on a CPU the later rows find it in cache); None: as s_per_kv_token
    s_per_shared_kv_token: float | None = None
    # a row drawn at a temperature > 0 beyond a greedy one (its logits widened to float32 on
    # the host, softmax and a draw over the vocabulary)
    s_per_sampled_row: float = 0.0

    def __post_init__(self) -> None:
        if (min(self.step_fixed_s, self.s_per_row, self.s_per_pair, self.s_per_fresh_kv_token,
                self.s_per_shared_kv_token or 0.0, self.s_per_sampled_row) < 0
                or self.s_per_token <= 0 or self.s_per_kv_token <= 0):
            raise ProfileError("step coefficients must be >= 0 (per-token and per-KV-token > 0)")


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """A device: datasheet peaks (FLOP/s, bandwidth, memory), how far it overlaps compute with
    memory traffic, and optionally a step-time model measured on the served model."""

    name: str
    flops: float  # peak dense FLOP/s
    bandwidth: float  # bytes/s
    kv_capacity_bytes: int | None = None  # bytes left for KV; None = derive from memory_bytes
    memory_bytes: int | None = None  # device memory; weights and ~10% workspace come off it
    batch_multiple: int = 128  # preferred token-count multiple for a step (1 on CPUs)
    # Share of the smaller of a step's compute and memory time hidden under the larger one:
    # 0 = they run one after the other (one stream: this runtime on any device today),
    # 1 = perfect overlap (an idealisation; `--perfect-overlap` in the simulator).
    overlap: float = 0.0
    step_overhead_s: float = 0.0  # launch and host time per step on top of the weight reads
    measured: StepCoefficients | None = None  # fitted step model (overrides the datasheet)
    model_config: dict[str, Any] | None = None  # HF config of the model the fit was made on
    free_steps: bool = False  # idealisation: W = 0 (`--free-weights` in the simulator)
    # Decode attention reads a prefix its decodes share once per step (the CPU runtime's
    # cascade, scheduler/simulate/cascade.py); the datasheet GPUs are simulated without it.
    cascade: bool = False
    # The step cap the engine takes on this device when none is set (a measured profile's;
    # None: the simulator's DEFAULT_MAX_STEP_TOKENS, the GPUs' 2048).
    default_step_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.flops <= 0 or self.bandwidth <= 0:
            raise ProfileError(f"profile {self.name!r}: flops and bandwidth must be > 0")
        if not 0.0 <= self.overlap <= 1.0:
            raise ProfileError(f"profile {self.name!r}: overlap must be in [0, 1]")

    @classmethod
    def named(cls, name: str) -> HardwareProfile:
        if name not in _PROFILES:
            known = ", ".join(sorted(_PROFILES))
            raise UnknownNameError(f"unknown hardware profile {name!r}; known: {known}")
        return _PROFILES[name]

    @classmethod
    def from_json(cls, path: str | Path) -> HardwareProfile:
        """Read a profile file: `blendserve profile`'s measured step model, or datasheet peaks
        (`{"name", "flops", "bandwidth_bytes_per_s", ...}`)."""
        try:
            data = json.loads(Path(path).read_text())
            return cls.from_dict(data)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, ProfileError):
                raise ProfileError(f"hardware profile {path}: {exc}") from exc
            raise ProfileError(f"cannot read hardware profile {path}: {exc!r}") from exc

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        step = data.get("step_model")
        measured = None if step is None else StepCoefficients(
            step_fixed_s=float(step["step_fixed_s"]),
            s_per_token=float(step["s_per_token"]),
            s_per_row=float(step.get("s_per_row", 0.0)),
            s_per_pair=float(step.get("s_per_pair", 0.0)),
            s_per_kv_token=float(step["s_per_kv_token"]),
            s_per_fresh_kv_token=float(step.get("s_per_fresh_kv_token", 0.0)),
            s_per_shared_kv_token=(None if step.get("s_per_shared_kv_token") is None
                                   else float(step["s_per_shared_kv_token"])),
            s_per_sampled_row=float(step.get("s_per_sampled_row", 0.0)),
        )
        flops = float(data["flops"])
        cap, mem = data.get("kv_capacity_bytes"), data.get("memory_bytes")
        # A GPU-class device prefers token counts in multiples of 128; a CPU does not care.
        multiple = data.get("batch_multiple") or (128 if flops >= 5e13 else 1)
        config = data.get("model_config")
        return cls(
            name=str(data.get("name", "measured")),
            flops=flops,
            bandwidth=float(data["bandwidth_bytes_per_s"]),
            kv_capacity_bytes=None if cap is None else int(cap),
            memory_bytes=None if mem is None else int(mem),
            batch_multiple=int(multiple),
            overlap=float(data.get("overlap", 0.0)),
            step_overhead_s=float(data.get("step_overhead_s", 0.0)),
            measured=measured,
            model_config=dict(config) if isinstance(config, dict) else None,
            cascade=bool(data.get("cascade", False)),
            default_step_tokens=data.get("default_step_tokens"),
        )

    def idealised(self, *, overlap: float | None = None, free_steps: bool = False) -> HardwareProfile:
        """This device with an idealisation switched on (for bracketing, never the default)."""
        return replace(self, overlap=self.overlap if overlap is None else overlap,
                       free_steps=self.free_steps or free_steps)


# Datasheet peaks. A GPU overlaps a step's GEMMs with its memory traffic (decode attention,
# weight reads) when the runtime splits the step into nano-batches on two streams (NanoFlow).
# Concurrent kernels slow each other down, so not all of the smaller side hides. We assume 90%
# hidden: BlendServe measured 86.5% of its optimum on real GPUs, which a balanced step costing
# max + (1 − e)·min allows only for e ≳ 0.85. `blendserve profile` on the device measures the
# real figure; the simulator's `--overlap`, `--no-overlap` and `--perfect-overlap` bracket it.
GPU_OVERLAP = 0.9
_PROFILES: dict[str, HardwareProfile] = {
    "h200": HardwareProfile("h200", flops=989e12, bandwidth=4.8e12, memory_bytes=141_000_000_000,
                            overlap=GPU_OVERLAP),
    "h100": HardwareProfile("h100", flops=989e12, bandwidth=3.35e12, memory_bytes=80_000_000_000,
                            overlap=GPU_OVERLAP),
    "a100": HardwareProfile("a100", flops=312e12, bandwidth=2.039e12, memory_bytes=80_000_000_000,
                            overlap=GPU_OVERLAP),
}

_WORKSPACE_FRACTION = 0.10  # activations, CUDA graphs, allocator slack


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds of compute and memory traffic for requests and steps; see DESIGN.md.

    One step-time model serves the planner and the simulator:
    t_step = overhead + combine(T_comp, T_kv + T_weights), combine = max + (1 − overlap)·min.
    Every step reads all weights (T_weights = P·bytes / B), so W = T_weights + overhead is the
    least a step costs; on a measured device (no overlap) the fitted fixed cost is all of W.
    """

    shape: ModelShape
    hardware: HardwareProfile

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shape.kv_bytes_per_token

    @property
    def seconds_per_token(self) -> float:
        """Linear-layer compute time of one token: 2·P / FLOPs (or measured)."""
        m = self.hardware.measured
        return m.s_per_token if m is not None else 2.0 * self.shape.params / self.hardware.flops

    @property
    def seconds_per_row(self) -> float:
        """Extra time per sampled row (measured; the datasheet model counts the LM head in P)."""
        m = self.hardware.measured
        return m.s_per_row if m is not None else 0.0

    @property
    def seconds_per_pair(self) -> float:
        """Prefill attention per (query, key) pair: QKᵀ and PV, 4·H_q·L FLOPs (or measured)."""
        m = self.hardware.measured
        if m is not None:
            return m.s_per_pair
        s = self.shape
        return 4.0 * s.heads * s.head_dim * s.layers / self.hardware.flops

    @property
    def seconds_per_kv_token(self) -> float:
        """Time to read one token's KV cache once: kv_bytes / B (or measured)."""
        m = self.hardware.measured
        return m.s_per_kv_token if m is not None else self.kv_bytes_per_token / self.hardware.bandwidth

    @property
    def seconds_per_shared_kv_token(self) -> float:
        """A decode's read of a KV token another decode of the step reads too: nothing where
        the attention cascades (the group reads it once), the measured rate where a profile has
        one (a CPU finds it in cache), else a plain read."""
        m = self.hardware.measured
        if self.hardware.cascade:
            return 0.0
        if m is not None and m.s_per_shared_kv_token is not None:
            return m.s_per_shared_kv_token
        return self.seconds_per_kv_token

    @property
    def seconds_per_sampled_row(self) -> float:
        """A row drawn at a temperature > 0 beyond a greedy row (measured; 0 otherwise)."""
        m = self.hardware.measured
        return m.s_per_sampled_row if m is not None else 0.0

    @property
    def seconds_per_fresh_kv_token(self) -> float:
        """A KV token's first write on a page the process never used (measured; 0 otherwise)."""
        m = self.hardware.measured
        return m.s_per_fresh_kv_token if m is not None else 0.0

    @property
    def weights_read_s(self) -> float:
        """Reading every weight once, which each step does: memory traffic like a KV read, so
        it overlaps with compute as far as the device overlaps (0 when measured: it is in the
        fitted fixed cost)."""
        if self.hardware.free_steps or self.hardware.measured is not None:
            return 0.0
        return self.shape.params * self.shape.dtype_bytes / self.hardware.bandwidth

    @property
    def step_overhead_s(self) -> float:
        """Per-step time that overlaps with nothing: launches, host scheduling (measured: the
        whole fitted fixed cost, as the measured device does not overlap)."""
        m = self.hardware.measured
        if self.hardware.free_steps:
            return 0.0
        return m.step_fixed_s if m is not None else self.hardware.step_overhead_s

    @property
    def step_fixed_s(self) -> float:
        """W: what every step costs whatever it holds: the weights' read plus overhead."""
        return self.weights_read_s + self.step_overhead_s

    @property
    def overlap(self) -> float:
        return self.hardware.overlap

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

    def comp(self, p: Any, d: Any, shared: Any = 0.0) -> Any:
        """Compute seconds of a request whose first `shared` prompt tokens are cached: the other
        prompt tokens and every output token through the linear layers, a sampled row per output
        token, and the prompt's causal attention ((p² − shared²)/2 query-key pairs)."""
        if _is_array(p, d, shared):
            p = np.asarray(p, dtype=np.float64)
            d = np.asarray(d, dtype=np.float64)
            shared = np.asarray(shared, dtype=np.float64)
        return ((p - shared + d) * self.seconds_per_token + d * self.seconds_per_row
                + (p * p - shared * shared) / 2.0 * self.seconds_per_pair)

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

    def step_compute_time(self, tokens: float, rows: float = 0.0, pairs: float = 0.0,
                          fresh_kv: float = 0.0, sampled: float = 0.0) -> float:
        """The step's compute; `fresh_kv`: KV tokens it writes on pages never used (host work
        of the OS, on the compute side); `sampled`: of its rows, those drawn at random."""
        return (float(tokens) * self.seconds_per_token + float(rows) * self.seconds_per_row
                + float(pairs) * self.seconds_per_pair
                + float(fresh_kv) * self.seconds_per_fresh_kv_token
                + float(sampled) * self.seconds_per_sampled_row)

    def step_memory_time(self, kv_tokens_read: float, shared: float = 0.0) -> float:
        """Memory traffic of one step: its KV reads (`shared` of them of tokens another decode
        of the step reads too) plus one read of the weights."""
        return ((float(kv_tokens_read) - float(shared)) * self.seconds_per_kv_token
                + float(shared) * self.seconds_per_shared_kv_token + self.weights_read_s)

    def combine(self, compute_s: Any, memory_s: Any) -> Any:
        """Compute and memory time of one step (or arrays of steps), overlapped as the device does."""
        hi, lo = np.maximum(compute_s, memory_s), np.minimum(compute_s, memory_s)
        out = hi + (1.0 - self.overlap) * lo
        return float(out) if np.ndim(out) == 0 else out

    def step_time(self, tokens: float, kv_tokens_read: float, rows: float = 0.0,
                  pairs: float = 0.0) -> float:
        """One step: overhead + combine(compute, KV reads + weights read)."""
        c = self.step_compute_time(tokens, rows, pairs)
        return self.step_overhead_s + float(self.combine(c, self.step_memory_time(kv_tokens_read)))

    def optimal_makespan(self, total_comp: float, total_mem: float, max_sharing: float,
                         min_steps: float = 0.0) -> float:
        """T_opt = max(C_eff, M_kv + W·S_min), C_eff = (1 − s_max)·ΣComp: a lower bound on any
        schedule (perfect overlap, DFS sharing, no more steps than the longest request or the
        step cap force, each paying one weights read)."""
        return max((1.0 - max_sharing) * total_comp, total_mem + self.step_fixed_s * min_steps)

    def device_floor(self, compute_s: float, kv_read_s: float, steps: float) -> float:
        """A lower bound on any schedule on this device, tighter than `optimal_makespan`: each
        step costs max(c, m) + (1 − overlap)·min(c, m), so summed over steps (the sum is
        monotone in both totals) T ≥ max(C, M) + (1 − overlap)·min(C, M), for any C and M no
        schedule goes below: here the compute every order must do, and the KV reads plus W
        for each of the steps none can do without (simulate/run.py: device_floor). Analysis
        only: the goals are stated against `optimal_makespan`."""
        return float(self.combine(float(compute_s), float(kv_read_s) + self.step_fixed_s * steps))

    @classmethod
    def default(cls) -> CostModel:
        """Llama-3-8B on an H200: the profile the project's goals are stated on."""
        return cls(ModelShape.named("llama-3-8b"), HardwareProfile.named("h200"))


def min_steps(longest_output: float, computed_tokens: float, step_cap: float) -> float:
    """S_min = max(longest output, computed tokens / step cap): no schedule takes fewer steps."""
    return max(float(longest_output), float(computed_tokens) / max(float(step_cap), 1.0))


def _is_array(*xs: Any) -> bool:
    return any(isinstance(x, np.ndarray) for x in xs)
