"""The `blend` admission policy: warm-up beside filler work, then a dual scan over the plan.

Lifecycle: (1) warm-up (warmup.py): a ~1% sample runs for its lengths while steps are filled
with work that needs no estimate (where compute and memory overlap, once the sample has
prefilled, only up to the step's memory time); (2) estimate the rest, sort and split (split.py)
into one sequence, compute-heavy left, memory-heavy right; the run keeps sampling: a request
that started at least as many steps ago as the longest output finished so far is a sample too
(its length, or its estimate while it runs, as long as at most a tenth of them run; later starts
are left out, as their short ones finish first), and what has not started is re-planned each
time those samples have doubled. A ~1% sample of a family of long generations is a dozen
requests; where the tail of a batch is long decodes, starting the family guessed shorter first
cost up to 1.7% of the makespan (simulator, memory_low_sharing). Only when blending: without
overlap, estimates at the mean let the KV-peak admission overcommit, and a preempted request
recomputes on compute nothing leaves idle (simulated CPU low_sharing x16: 0.998 -> 0.989 of the
best baseline);
(3) admission and pacing, which depend on the device's overlap (CostModel.overlap):

- Where compute and memory overlap (a GPU with two streams), the dual scan: each step the right
  cursor admits memory-heavy requests, longest first so long decodes start early, within
  M_R = M − M_L, M_L = M·(ρ_t − ρ_R)/(ρ_L − ρ_R) clamped to [0, M] (each request counted at
  its average occupancy p + d̂/2), while the KV the running requests will hold at its peak, as
  they grow and finish at their estimates (KvPeak), leaves the compute side its share. Where KV
  is what the steps are short of (memory leads and its reads at full capacity need more steps
  than the compute in full steps), the peak alone bounds the memory side, up to the whole
  capacity. A request that would decode longer than all the other work needs starts at once,
  wherever the plan put it, its prompt prefilled ahead of the queue (the critical path:
  `ahead_of_queue`); it is a memory-side request and, unless KV is short, fits M_R too: estimates
  come by subtree, so hundreds of requests may cross that line in one step, and started at once
  they filled the KV with long decodes and shut the compute side out (simulated compute_high,
  20k requests, seed 6: 203 in one step, 804 in all; steps 6,000-10,000 memory-bound; 347.6 s,
  now 338.2). The left cursor admits compute-heavy requests
  as the prefill queue drains, in the KV the reservations leave or, past them, in free KV where
  the running requests' KV peak allows (a reservation is an estimate, raised at once when its
  request outgrows it, so reservations can claim more than is held); once memory leads and it
  reaches clearly memory-heavy requests (Comp < MEMORY_HEAVY_RHO·Mem), the compute side takes
  them from the right end instead, longest first. Pacing: a step's compute under its memory time
  (KV reads + one weights read) costs only the non-overlapped share, so the prefill budget fills
  compute up to that memory time (leaning 10% past it while compute is the larger remainder, 5%
  short of it while memory is; where the longest running decode at its estimate and at its
  overrun allowance disagree on that, as the steps paced so far were bound; prompt attention
  counted). It keeps up with the critical-path pace (remaining compute / steps) only where
  compute leads even with every running decode at its overrun allowance and no censored sample
  runs, at those allowances: the pace rests on estimated lengths, and a path guessed short
  spends the compute early and leaves the longest decodes alone in weight-bound steps, where one
  guessed long costs only a compute-bound tail (which, filled to the memory time alone, paid a
  weights read per few hundred tokens: ~8,000 steps, compute_high 346.6 s, now 344.4; at the
  estimates' pace the compute traces took +0.7…+23 s, and while censored samples ran the
  memory traces +18…+30 s). The prefill queue keeps up with that pace, and the memory side
  admits while its steady-state read fits max(remaining compute, remaining
  memory + W·steps) / steps, steps being the most of the decode steps the longest request may
  still need (overruns allowed for) and the steps the remaining KV reads need at full capacity;
  where KV is short, reading less than it holds only adds steps, so a memory-heavy request
  skips that check, and estimated lengths may take the KV peak 10% past the capacity (they are
  means: a request preempted when the peak comes true recomputes on idle compute). Warm-up
  filler of unknown length counts as decoding twice the warm-up's steps, and the plan raises a
  running request's estimate to its subtree's. While samples censored at the deadline still
  run, their subtrees' memory work is a lower bound: the memory side's admission takes compute
  to lead only past r_mem times the overrun factor. The pace takes memory to lead there only
  where it does both at that bound and with the steps counted to the end a censored sample may
  still reach (its max_tokens, a weights read each): each alone is right at one scale. A
  reasoning family's long decodes bound the compute traces at 5k requests (M + W·S_min), not
  at 20k (their compute does): the overrun bound alone gained 1.0-1.3% at 5k and lost
  1.0-1.3% at 20k, max_tokens alone lost 0.7% on memory_low at 5k; both together gain 1.0% and
  1.3% on 5k's compute traces (memory_high +0.24%, memory_low +0.02%), 0.2-0.7% at 2k, lose
  0.15% and 0.09% on 20k's (its memory traces −0.04%, +0.01%; simulated, mean of seeds 0-9);
  held to both bounds, the admission lost 0.2-0.4% more at 20k. Their own estimates (twice
  what they have run) already treat them as halfway, so the KV peak counts every running
  request at its estimate.
- Where they do not overlap (this CPU runtime), mixing hides nothing: every step costs W plus
  its compute plus its memory, so only the step count and the prefix sharing can change. The plan
  keeps the sharing order (no splitting), puts the subtrees with the longest decodes first (they
  set the step count), admits while the running requests' KV peak at their estimates fits,
  and never paces: full steps. Once 16 outputs of unknown length have ended, the peak is
  forecast instead (KvForecast): each request runs on as the Kaplan-Meier survival of the
  lengths seen so far (relative to the estimates they started with; running requests censored
  at what they have generated) says, plus two standard deviations; past the longest length
  seen, to its max_tokens. Without a sample, estimates are max_tokens, and a KV-bound batch of
  EOS-ended outputs ran fewer requests at once than it could (simulated low_sharing at 4x and
  16x: 0.994-0.999 of the best baseline, 0.995-1.001 with the forecast). Where the lengths left
  are certain (known, or every output so far ran to its max_tokens) and the batch does not fit
  at once, a request also starts no sooner than a latest-start packing says (stagger.py):
  admitted as the peak fits, such a batch runs in waves, the last few requests decoding a
  whole wave nearly alone. Each request counts its pages' slack (page_slack): in the engine,
  the packing's peak at the pool's size without it preempted.
"""

from scheduler.dual_scan.memory import KvPeak, MemorySplit, split_memory, steady_prefill
from scheduler.dual_scan.policy import FILLER_KV_SHARE, PACE_LEAN_PAST, BlendPolicy

__all__ = [
    "FILLER_KV_SHARE",
    "PACE_LEAN_PAST",
    "BlendPolicy",
    "KvPeak",
    "MemorySplit",
    "split_memory",
    "steady_prefill",
]
