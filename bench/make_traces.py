"""Synthetic, seeded request traces in the BlendServe paper's workload families and its 2×2 grid.

Why synthetic: the paper's traces (MMLU, BurstGPT, Azure, OpenVid, reasoning) cannot be downloaded
at run time, so each family is reproduced by its shape — prompt length, output length, and how
prompts share prefixes — which is all the planner and the simulator look at. Output lengths depend
on the family and on the prefix group (a per-group factor), so sampling a subtree says something
about its unsampled neighbours, as with real tasks.

Prompt = family header (shared by the whole family) + group prefix (shared by a group, e.g. one
MMLU subject's few-shot examples) + a unique suffix. A mix is calibrated in two steps: the share of
long-output requests is solved so ρ(root) hits the target on the cost model, then the group-prefix
lengths are scaled so the trace's maximum prefix-sharing ratio hits the target. The grid:
compute-heavy mixes ρ = 1.5, memory-heavy ρ = 0.6 (H200 + Llama-3-8B), × sharing 0.35 or 0.05.

    python bench/make_traces.py --grid --out bench/out/traces --requests 5000 --seed 0
    python bench/make_traces.py --family openvid --out bench/out/traces --requests 1000
    python bench/make_traces.py --scale --out bench/out/traces      # 200k requests, ~30M tokens
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.cost_model import CostModel, HardwareProfile, ModelShape

VOCAB_LOW, VOCAB_HIGH = 1000, 128000  # token ids drawn from here (inside Llama-3's vocabulary)


@dataclass(frozen=True)
class Family:
    """Length and sharing shape of one workload family (lengths in tokens)."""

    name: str
    prompt_mean: float  # mean prompt length (lognormal)
    prompt_sigma: float  # lognormal sigma of the prompt length
    prompt_max: int
    output_mean: float  # mean output length (lognormal); ignored when output_uniform is set
    output_sigma: float
    output_max: int
    header_len: int  # prefix shared by every request of the family (system prompt / template)
    group_size: float  # mean requests per prefix group (geometric), or exact when group_fixed
    group_prefix_frac: float  # group prefix length as a fraction of prompt_mean, before scaling
    group_output_sigma: float = 0.3  # spread of the per-group output-length factor
    output_uniform: tuple[int, int] | None = None  # exact uniform output range (MMLU answers)
    group_fixed: bool = False  # every group has exactly group_size requests
    scale_sharing: bool = True  # False: group prefixes keep their natural length in a mix


FAMILIES: dict[str, Family] = {
    # 5-shot MMLU: a subject's few-shot examples are shared by every question of that subject.
    "mmlu": Family("mmlu", 820, 0.1, 4096, 0, 0, 5, header_len=24, group_size=60,
                   group_prefix_frac=0.75, output_uniform=(1, 5), group_fixed=True,
                   scale_sharing=False),
    # BurstGPT-like chat: short prompts, short answers, some shared system prompts.
    "burstgpt": Family("burstgpt", 244, 0.9, 8192, 27, 0.9, 1024, header_len=8, group_size=8,
                       group_prefix_frac=0.4),
    # Azure-trace-like: long prompts (code / documents), very short outputs.
    "azure": Family("azure", 2500, 0.6, 16000, 23, 0.8, 512, header_len=8, group_size=8,
                    group_prefix_frac=0.4),
    # OpenVid-like generation: a short caption in, thousands of (video) tokens out.
    "openvid": Family("openvid", 120, 0.3, 512, 3000, 0.35, 8192, header_len=24, group_size=8,
                      group_prefix_frac=0.3),
    # Long reasoning outputs.
    "reasoning": Family("reasoning", 400, 0.6, 4096, 4000, 0.6, 16384, header_len=16,
                        group_size=8, group_prefix_frac=0.4),
}


@dataclass(frozen=True)
class Mix:
    """One trace of the grid: which families, in what proportion, and the targets to calibrate."""

    name: str
    short: dict[str, float]  # compute-heavy families (short outputs) → weight among them
    long: dict[str, float]  # memory-heavy families (long outputs) → weight among them
    target_rho: float  # ρ(root) = (1 − s)·ΣComp / ΣMem on the cost model
    target_sharing: float  # maximum prefix-sharing ratio of the trace


_SHORT_HS = {"mmlu": 0.3, "burstgpt": 0.35, "azure": 0.35}
_SHORT_LS = {"burstgpt": 0.5, "azure": 0.5}
_LONG = {"openvid": 0.6, "reasoning": 0.4}
MIXES: dict[str, Mix] = {
    "compute_high_sharing": Mix("compute_high_sharing", _SHORT_HS, _LONG, 1.5, 0.35),
    "compute_low_sharing": Mix("compute_low_sharing", _SHORT_LS, _LONG, 1.5, 0.05),
    "memory_high_sharing": Mix("memory_high_sharing", _SHORT_HS, _LONG, 0.6, 0.35),
    "memory_low_sharing": Mix("memory_low_sharing", _SHORT_LS, _LONG, 0.6, 0.05),
}
# The planning-speed trace: 200k chat-sized requests, ~30M prompt tokens (mean ≈ 150).
SCALE_MIX = Mix("scale", {"mmlu": 0.2, "burstgpt": 0.8}, {"openvid": 0.7, "reasoning": 0.3},
                1.2, 0.35)
SCALE_FAMILIES = {"mmlu": replace(FAMILIES["mmlu"], prompt_mean=260, group_size=400),
                  "burstgpt": replace(FAMILIES["burstgpt"], prompt_mean=115)}


@dataclass(frozen=True)
class TraceRequest:
    """One trace line: what the simulator reads (`output_len` is the true length)."""

    id: str
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class TraceStats:
    """Aggregate shape of a trace on a cost model (times in seconds)."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    mean_prompt: float
    mean_output: float
    max_sharing: float  # 1 − unique prompt tokens / all prompt tokens (DFS, unbounded cache)
    total_comp_s: float
    total_mem_s: float
    rho: float  # (1 − max_sharing)·ΣComp / ΣMem


@dataclass
class _Specs:
    """Per-request lengths and prefix structure, before any tokens exist (arrays of one length)."""

    family: list[str]
    group: np.ndarray  # global group id
    prompt: np.ndarray  # prompt length
    output: np.ndarray  # true output length
    header: np.ndarray  # family header length
    group_prefix: np.ndarray  # this request's group-prefix length (same within a group)


def default_cost_model() -> CostModel:
    return CostModel(ModelShape.named("llama-3-8b"), HardwareProfile.named("h200"))


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2
    return rng.lognormal(mu, sigma, n)


def _family_pool(fam: Family, n: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """n requests of a family: (prompt, output, group index within the family)."""
    if fam.group_fixed:
        group = np.arange(n) // max(1, int(fam.group_size))
    else:
        sizes = rng.geometric(1.0 / fam.group_size, n)
        group = np.repeat(np.arange(n), sizes)[:n]
    n_groups = int(group.max()) + 1
    prompt = np.clip(_lognormal(rng, fam.prompt_mean, fam.prompt_sigma, n), 1, fam.prompt_max)
    if fam.output_uniform is not None:
        lo, hi = fam.output_uniform
        output = rng.integers(lo, hi + 1, n).astype(float)
    else:
        factor = _lognormal(rng, 1.0, fam.group_output_sigma, n_groups)[group]
        output = _lognormal(rng, fam.output_mean, fam.output_sigma, n) * factor
    output = np.clip(np.rint(output), 1, max(fam.output_max, 1))
    return np.rint(prompt).astype(np.int64), output.astype(np.int64), group


def _comp_mem(cm: CostModel, prompt: np.ndarray, output: np.ndarray) -> tuple[np.ndarray, ...]:
    p, d = prompt.astype(np.float64), output.astype(np.float64)
    return np.asarray(cm.comp(p, d), dtype=np.float64), np.asarray(cm.mem(p, d), dtype=np.float64)


def _solve_counts(mix: Mix, pools: dict, n: int, cm: CostModel) -> dict[str, int]:
    """Per-family request counts whose (1 − s)·ΣComp/ΣMem hits the target ρ.

    Bisects the long-output share x on the requests actually taken (prefix sums over each pool),
    so the few long requests that dominate ΣMem are counted exactly, not by a noisy mean.
    """
    cums = {name: (np.concatenate(([0.0], np.cumsum(c))), np.concatenate(([0.0], np.cumsum(m))))
            for name, (c, m) in ((name, _comp_mem(cm, pools[name][0], pools[name][1]))
                                 for name in [*mix.short, *mix.long])}

    def counts(x: float) -> dict[str, int]:
        out: dict[str, int] = {}
        for weights, share in ((mix.short, 1.0 - x), (mix.long, x)):
            total = sum(weights.values())
            for name, w in weights.items():
                out[name] = round(n * share * w / total)
        first = next(iter(out))
        out[first] += n - sum(out.values())  # rounding remainder
        return out

    def rho(x: float) -> float:
        k = counts(x)
        comp = sum(cums[f][0][k[f]] for f in k)
        mem = sum(cums[f][1][k[f]] for f in k)
        return (1.0 - mix.target_sharing) * comp / mem if mem > 0 else float("inf")

    if not mix.short or not mix.long:
        return counts(float(bool(mix.long)))
    lo, hi = 0.0, 1.0  # rho falls as x grows
    if not rho(hi) <= mix.target_rho <= rho(1.0 / n):
        raise ValueError(f"mix {mix.name}: target ρ {mix.target_rho} is out of reach")
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rho(mid) > mix.target_rho else (lo, mid)
    return counts(lo if abs(rho(lo) - mix.target_rho) < abs(rho(hi) - mix.target_rho) else hi)


def _specs(mix: Mix, n: int, seed: int, cm: CostModel,
           families: dict[str, Family] | None = None) -> _Specs:
    fams = {**FAMILIES, **(families or {})}
    rng = np.random.default_rng(seed)
    names = [*mix.short, *mix.long]
    pools = {name: _family_pool(fams[name], n, rng) for name in names}
    counts = _solve_counts(mix, pools, n, cm)
    family: list[str] = []
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("g", "p", "d", "h", "f")}
    group_base = 0
    for name in names:
        k = counts[name]
        if k <= 0:
            continue
        fam = fams[name]
        prompt, output, group = (a[:k] for a in pools[name])
        family += [name] * k
        parts["g"].append(group + group_base)
        group_base += int(group.max()) + 1
        parts["p"].append(prompt)
        parts["d"].append(output)
        parts["h"].append(np.full(k, fam.header_len))
        base = fam.group_prefix_frac * fam.prompt_mean
        parts["f"].append(np.full(k, base if fam.scale_sharing else -base))
    g, p, d, h, f = (np.concatenate(parts[k]) for k in ("g", "p", "d", "h", "f"))
    specs = _Specs(family, g, p, d, h, np.zeros_like(p))
    _calibrate_sharing(specs, f, mix.target_sharing)
    order = rng.permutation(len(p))  # file order: families and groups interleaved
    return _Specs([specs.family[i] for i in order], g[order], specs.prompt[order],
                  d[order], h[order], specs.group_prefix[order])


def _apply_prefix(specs: _Specs, base: np.ndarray, alpha: float) -> None:
    """Group prefix = alpha·base (or the natural |base| where base < 0); prompts grow to fit."""
    length = np.where(base < 0, -base, alpha * base)
    # one length per group: the group's first request decides
    _, first = np.unique(specs.group, return_index=True)
    per_group = np.zeros(int(specs.group.max()) + 1)
    per_group[specs.group[first]] = np.rint(length[first])
    specs.group_prefix = per_group[specs.group].astype(np.int64)
    specs.prompt = np.maximum(specs.prompt, specs.header + specs.group_prefix + 1)


def _calibrate_sharing(specs: _Specs, base: np.ndarray, target: float) -> None:
    """Bisect the group-prefix scale so max_sharing hits the target (prompts are length-fixed)."""
    original = specs.prompt.copy()

    def sharing(alpha: float) -> float:
        specs.prompt = original.copy()
        _apply_prefix(specs, base, alpha)
        return _max_sharing(specs)

    lo, hi = 0.0, 1.0
    while sharing(hi) < target and hi < 64:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sharing(mid) < target else (lo, mid)
    sharing(hi)


def _max_sharing(specs: _Specs) -> float:
    total = int(specs.prompt.sum())
    fams = sorted(set(specs.family))
    fam_arr = np.array(specs.family)
    unique = sum(int(specs.header[fam_arr == f][0]) for f in fams)
    _, first = np.unique(specs.group, return_index=True)
    unique += int(specs.group_prefix[first].sum())
    unique += int((specs.prompt - specs.header - specs.group_prefix).sum())
    return 1.0 - unique / total


def _stats(specs: _Specs, cm: CostModel) -> TraceStats:
    comp, mem = _comp_mem(cm, specs.prompt, specs.output)
    s = _max_sharing(specs)
    return TraceStats(len(specs.prompt), int(specs.prompt.sum()), int(specs.output.sum()),
                      float(specs.prompt.mean()), float(specs.output.mean()), s,
                      float(comp.sum()), float(mem.sum()),
                      float((1 - s) * comp.sum() / mem.sum()))


def _iter_requests(specs: _Specs, prefix: str, seed: int) -> Iterator[TraceRequest]:
    """Materialise token ids one request at a time (the scale trace never sits in memory)."""
    rng = np.random.default_rng(seed + 1)
    headers: dict[str, np.ndarray] = {}
    group_tokens: dict[int, np.ndarray] = {}
    for i, name in enumerate(specs.family):
        h = int(specs.header[i])
        if name not in headers:
            headers[name] = rng.integers(VOCAB_LOW, VOCAB_HIGH, h)
        g = int(specs.group[i])
        if g not in group_tokens:
            group_tokens[g] = rng.integers(VOCAB_LOW, VOCAB_HIGH, int(specs.group_prefix[i]))
        unique = rng.integers(VOCAB_LOW, VOCAB_HIGH, int(specs.prompt[i]) - h - len(group_tokens[g]))
        tokens = np.concatenate([headers[name], group_tokens[g], unique])
        yield TraceRequest(f"{prefix}-{i:06d}-{name}", tokens.tolist(), int(specs.output[i]))


def generate_mix(name: str, n: int, seed: int = 0, cost_model: CostModel | None = None
                 ) -> tuple[list[TraceRequest], TraceStats]:
    """A grid mix (see MIXES) of n requests, calibrated on `cost_model` (default H200 + 8B)."""
    cm = cost_model or default_cost_model()
    specs = _specs(MIXES[name], n, seed, cm)
    return list(_iter_requests(specs, name, seed)), _stats(specs, cm)


def generate_family(name: str, n: int, seed: int = 0, sharing: float | None = None,
                    cost_model: CostModel | None = None) -> tuple[list[TraceRequest], TraceStats]:
    """n requests of one family; `sharing` calibrates its prefix-sharing ratio (default: natural)."""
    cm = cost_model or default_cost_model()
    fam = FAMILIES[name]
    rng = np.random.default_rng(seed)
    prompt, output, group = _family_pool(fam, n, rng)
    specs = _Specs([name] * n, group, prompt, output, np.full(n, fam.header_len),
                   np.zeros_like(prompt))
    base = np.full(n, fam.group_prefix_frac * fam.prompt_mean)
    if sharing is None:
        _apply_prefix(specs, base, 1.0)
    else:
        _calibrate_sharing(specs, base, sharing)
    return list(_iter_requests(specs, name, seed)), _stats(specs, cm)


def write_trace(path: Path, requests: Sequence[TraceRequest] | Iterator[TraceRequest]) -> int:
    """Write trace JSONL; returns the number of lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with path.open("w") as f:
        for r in requests:
            ids = ",".join(map(str, r.prompt_token_ids))
            f.write(f'{{"id": {json.dumps(r.id)}, "prompt_token_ids": [{ids}], '
                    f'"output_len": {r.output_len}}}\n')
            count += 1
    return count


def write_scale_trace(path: Path, n: int = 200_000, seed: int = 0,
                      cost_model: CostModel | None = None) -> TraceStats:
    """The planning-speed trace: n requests, ~150 prompt tokens each (~30M at 200k), streamed."""
    cm = cost_model or default_cost_model()
    specs = _specs(SCALE_MIX, n, seed, cm, SCALE_FAMILIES)
    write_trace(path, _iter_requests(specs, "scale", seed))
    return _stats(specs, cm)


def _stats_line(name: str, path: Path, stats: TraceStats) -> str:
    return json.dumps({"trace": name, "path": str(path), **{
        k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.__dict__.items()}})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--grid", action="store_true", help="the 2×2 grid of mixes")
    mode.add_argument("--family", choices=sorted(FAMILIES))
    mode.add_argument("--mix", choices=sorted(MIXES))
    mode.add_argument("--scale", action="store_true", help="200k requests, ~30M tokens")
    ap.add_argument("--out", type=Path, default=Path("bench/out/traces"))
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sharing", type=float, default=None, help="--family: target sharing")
    args = ap.parse_args(argv)
    if args.scale:
        path = args.out / "scale.jsonl"
        stats = write_scale_trace(path, args.requests or 200_000, args.seed)
        print(_stats_line("scale", path, stats))
        return 0
    n = args.requests or 5000
    if args.family:
        reqs, stats = generate_family(args.family, n, args.seed, args.sharing)
        jobs = [(args.family, reqs, stats)]
    else:
        names = sorted(MIXES) if args.grid else [args.mix]
        jobs = [(name, *generate_mix(name, n, args.seed)) for name in names]
    for name, reqs, stats in jobs:
        path = args.out / f"{name}.jsonl"
        write_trace(path, reqs)
        print(_stats_line(name, path, stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
