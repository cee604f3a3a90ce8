"""What crosses the runtime ↔ scheduler boundary: requests to plan, step budgets, the policy protocol.

The engine (runtime/) and the simulator (scheduler/simulate.py) drive the same policy objects
through `AdmissionPolicy`; the scheduler never calls the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """One request as the planner sees it."""

    id: str  # unique within a batch (the engine's request id)
    prompt_token_ids: Sequence[int]  # chat template already applied
    max_tokens: int  # output cap, >= 1
    known_output_len: int | None = None  # exact output length when known (ignore_eos); else None
    # Structured output: its format bounds the output, so it gets its own prior (tokens, before
    # any sample; None = the global prior) and is estimated only from requests of its own
    # length group (same format key); None = free text.
    output_prior: float | None = None
    length_group: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class StepBudget:
    """What the executor (engine or simulator) can take at the start of one step."""

    kv_capacity_tokens: int  # total KV slots of the cache (pages × page size)
    free_kv_tokens: int  # slots free now, counting evictable prefix-cache pages as free
    running: int  # requests admitted and not yet finished (prefilling or decoding)
    waiting_prefill_tokens: int  # admitted prompt tokens not yet prefilled


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Decides which requests enter the running batch and how much prefill each step carries.

    Contract:
    - `admit` returns requests in the order they should start; each is returned exactly once.
      The executor queues them and prefills them in that order; it never drops one.
    - `ahead_of_queue` (optional, see `ahead_of_queue()` below): how many of the last `admit`'s
      requests, from its front, the executor prefills before the prompts queued earlier.
    - `prefill_budget` is the number of prefill tokens the next step may carry (pacing);
      None means "as many as the executor's own token budget allows".
    - `on_finish` is called once per request with its real output length.
    - `on_progress` may be called with a running request's generated length so far; a policy
      may use it to correct an estimate that the request has overrun.
    - `has_pending` is False once every request has been returned by `admit`.
    - `withdraw` removes and returns every request not yet returned by `admit` (so a caller can
      re-plan what is left together with new arrivals); afterwards `has_pending` is False.
    """

    def admit(self, budget: StepBudget) -> list[PlanRequest]: ...

    def prefill_budget(self, budget: StepBudget) -> int | None: ...

    def on_finish(self, request_id: str, output_len: int) -> None: ...

    def on_progress(self, request_id: str, generated: int) -> None: ...

    def has_pending(self) -> bool: ...

    def withdraw(self) -> list[PlanRequest]: ...


def ahead_of_queue(policy: object) -> int:
    """How many of the requests `policy`'s last `admit` returned, from its front, go ahead of
    the prompts already queued (blend's critical-path starts: a decode that would make the
    tail alone must start now, not after a queue paced over hundreds of steps). 0 for a policy
    without the method: its requests queue behind the others."""
    ahead = getattr(policy, "ahead_of_queue", None)
    return int(ahead()) if callable(ahead) else 0
