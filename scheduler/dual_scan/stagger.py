"""Where the batch does not fit in the KV cache at once: start each request as late as it can.

Admitted in plan order while the running requests' KV peak fits, a KV-bound batch starts in
waves: a request holds its prompt and what it has generated, so a wave fills the cache only at
its end, and what did not fit waits for the whole wave. 144 requests of 256 tokens whose first
wave held 130 took 512 steps, the last 14 decoding nearly alone. Packed backwards from the end,
a request holds its most KV where it is placed, so little is wasted: the last requests make a
full wave, earlier ones start staggered, the first few alone (the same batch: 334 steps, in the
simulator and in the engine). `Stagger` packs the requests not started so, around the running
ones, at the shortest makespan it finds, then moves each, in plan order, as early as the cache
has room (the makespan stays; where the latest starts left it nearly empty at first, more start
now, and the run shows its lengths sooner); the policy starts none before its packed start,
and each only where its KV peak fits. A prefix a request shares with the next counts as held
throughout (it may end before them). It packs only the last two waves' worth: packing every wave
of identical requests takes 15-30% fewer steps, but on this CPU's KV-read-bound steps that was
0.5-0.7% of the seconds (low_sharing 16x and 64x), and the packing's cost grows with the square
of the batch. It packs on the lengths known, the others at max_tokens, until the run shows
outputs ending early (RunLengths.may_all_run_to_max): a bet that they run to it, which the
first wave's reservation at max_tokens makes anyway. Where most do (SmolLM2 ended 15 of 144
early), waves took 480-512 steps where the baselines took 263-289 (0.969-0.973x in the
simulator, 0.971x in the engine); packed, 334-371 (0.988-0.992x). Where outputs end early, the
bet costs the steps until four ends, and a fifth of those started, show it. Against staggering
only known lengths or after 16 outputs all ran to max_tokens, on `bench/cpu_scale_sweep.py`'s
128 runs of uncertain lengths: uniform and bimodal 0.1% behind in the mean (-1.2% to +1.1% a
run), max and mostly_max 0.35% ahead (up to +2.2% a run; worst runs 0.986x and 0.969x -> 1.000x
and 0.988x the best baseline). Moving each start as early as the cache has room (`_sooner`)
lets more start at once and so shows early ends sooner (bimodal 6x: the bet called off at step
16, not 48): of the sweep's 448 runs (5 modes at scales 3-8 seeds 0-3, 4 modes at 2-12 seeds
4-7 with long_short), 25 faster, up to 0.7% (bimodal 3x), and one slower, bimodal 6x seed 3
(-1.3%: a forecast holds the last requests until the first wave ends, as it did before).
"""

from __future__ import annotations

import math

import numpy as np

from scheduler.dual_scan.memory import KvPeak, page_slack

BLOCK = 4  # steps per time slot of the packing, at least; KV is counted at a slot's end
SLOTS = 128  # ... and at most this many slots over the longest request or running decode
MIN_GAIN = 0.02  # start late only where that ends the batch this much sooner
REPACK_STEPS = 16  # pack anew this often while requests wait for their start
MAX_SHARED_SHARE = 0.05  # no packing where prefixes shared with the next hold more of the KV
MAX_WAVES = 2.0  # ... nor before the KV-steps left fit in this many of the longest decode


def _footprint(held: float, steps: float, block: int) -> np.ndarray:
    """KV a request holding `held` tokens and decoding `steps` more holds in each slot."""
    n = max(math.ceil(steps / block), 1)
    return held + np.minimum(np.arange(1, n + 1) * block, max(steps, 1.0))


def _latest(running: np.ndarray, prints: list[np.ndarray], capacity: float,
            slots: int) -> np.ndarray | None:
    """Latest start slots (plan order, non-decreasing) ending by `slots`; None if one would
    have to start before now."""
    used = np.zeros(slots)
    used[:min(slots, len(running))] = running[:slots]
    starts = np.zeros(len(prints), dtype=np.int64)
    nxt = slots
    for j in range(len(prints) - 1, -1, -1):
        f = prints[j]
        s = min(slots - len(f), nxt)
        while s >= 0 and np.any(used[s:s + len(f)] + f > capacity):
            s -= 1
        if s < 0:
            return None
        used[s:s + len(f)] += f
        starts[j] = nxt = s
    return starts


def _first_fit(used: np.ndarray, f: np.ndarray, t: int, stop: int, capacity: float) -> int:
    """The first slot from `t` at which footprint `f` fits on `used`, or `stop` if none before."""
    while t < stop and np.any(used[t:t + len(f)] + f > capacity):
        t += 1
    return t


def _sooner(running: np.ndarray, prints: list[np.ndarray], capacity: float,
            starts: np.ndarray) -> np.ndarray:
    """`starts` (non-decreasing) each moved as early as it fits, in plan order: the makespan
    stays, and where the packing left the cache room early, more requests start sooner."""
    used = np.zeros(max(len(running), max(s + len(f) for s, f in zip(starts, prints))))
    used[:len(running)] = running
    for s, f in zip(starts, prints):
        used[s:s + len(f)] += f
    out = starts.copy()
    prev = 0
    for j, f in enumerate(prints):
        s = int(starts[j])
        used[s:s + len(f)] -= f
        t = _first_fit(used, f, prev, s, capacity)
        used[t:t + len(f)] += f
        out[j] = prev = t
    return out


def _earliest_end(running: np.ndarray, prints: list[np.ndarray], capacity: float) -> int:
    """Slots to the last end when each request starts, in plan order, as soon as its whole
    footprint fits (what admitting while the KV peak fits does)."""
    used = np.zeros(len(running) + sum(len(f) for f in prints))
    used[:len(running)] = running
    s = end = 0
    for f in prints:
        s = _first_fit(used, f, s, max(len(running), end), capacity)
        used[s:s + len(f)] += f
        end = max(end, s + len(f))
    return max(end, len(running))


def latest_starts(running: KvPeak, prompt: np.ndarray, output: np.ndarray, capacity: float,
                  guess: float = 0.0, shared: np.ndarray | None = None
                  ) -> tuple[np.ndarray, float] | None:
    """Steps from now at which requests not started (`prompt`: the KV each adds, its pages'
    slack included; `output`: its length; in plan order) start at the latest, packed backwards
    around the `running` requests into `capacity` at the shortest makespan found, and that
    makespan; None where none is found or it is not MIN_GAIN shorter than starting each as
    soon as it fits. `shared`: the prompt tokens each shares with the one before it; what a
    request shares with the next is counted as held throughout, since the request may end
    first, and where that is more than MAX_SHARED_SHARE of the KV (the groups of a chat batch)
    none is packed. `guess`: a makespan to search from (the last packing's, less the steps
    since)."""
    if shared is not None:
        tails = np.maximum(np.append(shared[1:], 0.0) - shared, 0.0)
        if tails.sum() > MAX_SHARED_SHARE * capacity:
            return None  # held throughout, they would make the packing wrong, not safe
        prompt, capacity = prompt - tails, capacity - float(tails.sum())
    held, left, base = running.rows()
    longest = max(float(np.max(left, initial=0.0)), float(np.max(output, initial=0.0)))
    kv_steps = float(np.sum(held * left + left * left / 2) + np.sum(prompt * output
                                                                   + output * output / 2))
    if kv_steps > MAX_WAVES * longest * capacity:
        return None  # far from the end: what the packing gains is the last waves' (and it
        # costs time in the number of requests)
    block = max(BLOCK, math.ceil(longest / SLOTS))
    run = np.full(math.ceil(float(np.max(left, initial=0.0)) / block), base)
    for h, r in zip(held, left):
        f = _footprint(float(h), float(r), block)
        run[:len(f)] += f
    prints = [_footprint(float(p), float(d), block) for p, d in zip(prompt, output)]
    if not prints:
        return None
    # Lower bound: the longest decode, or the KV-steps all need spread over the whole cache.
    need = float(np.sum(run)) + sum(float(np.sum(f)) for f in prints)
    lo = max(len(run), max(len(f) for f in prints), math.ceil(need / capacity))
    serial = lo + sum(len(f) for f in prints)  # one after another
    hi, step = min(max(lo, math.ceil(guess / block)), serial), 1
    while (best := _latest(run, prints, capacity, hi)) is None:  # up from the guess
        if hi >= serial:
            return None
        lo, hi, step = hi + 1, min(hi + step, serial), 2 * step
    step = 1
    while lo < hi:  # down: galloping, then halving what is left
        mid = max(lo, hi - step) if step else (lo + hi) // 2
        starts = _latest(run, prints, capacity, mid)
        if starts is None:
            lo, step = mid + 1, 0
        else:
            hi, best = mid, starts
            step *= 2
    if hi > _earliest_end(run, prints, capacity) * (1.0 - MIN_GAIN):
        return None
    best = _sooner(run, prints, capacity, best)
    return best.astype(np.float64) * block, float(hi * block)


class Stagger:
    """The plan positions due to start: packed anew every REPACK_STEPS steps, or once every
    request of the last packing has started."""

    def __init__(self) -> None:
        self._at = -REPACK_STEPS  # the step of the last packing
        self._lo = 0  # plan position of its first request
        self._starts = np.zeros(0)  # steps after `_at` at which each may start
        self._end = 0.0  # its makespan, steps after `_at`

    def stale(self, step: int, lo: int) -> bool:
        return step - self._at >= REPACK_STEPS or lo - self._lo >= len(self._starts)

    def pack(self, step: int, lo: int, running: KvPeak | None, prompt: np.ndarray,
             computed: np.ndarray, output: np.ndarray, capacity: float) -> None:
        """Pack plan positions lo… (`prompt` tokens, `computed` of them not shared with the one
        before, `output`) around `running`; with None (lengths not certain), or where all fit
        at once, each starts when it fits. The first counts its whole prompt: the running
        request it shares a prefix with may end before it."""
        packed = None
        computed = np.concatenate((prompt[:1], computed[1:]))
        held = computed + page_slack(prompt, computed)
        if running is not None and running.with_requests(held, output) > capacity:
            packed = latest_starts(running, held, output, capacity, self._end - (step - self._at),
                                   prompt - computed)
        self._starts, self._end = packed or (np.zeros(len(prompt)), 0.0)
        self._at, self._lo = step, lo

    def due(self, step: int) -> int:
        """Plan position before which requests may start at `step`."""
        return self._lo + int(np.searchsorted(self._starts, step - self._at, side="right"))
