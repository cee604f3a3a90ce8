"""One admission policy over requests that keep arriving: several batches, priority levels.

A worker's engine runs the requests of every batch it holds at once. `MixPolicy` keeps one
planned policy per priority level (the batches of equal priority are planned together, so two
teams sharing a system prompt share its KV) and rebuilds a level's plan whenever requests join
or leave it: the level's current policy gives back what it has not admitted (`withdraw`), and a
new one plans that together with the newcomers. A withdrawn policy stays on to account for the
requests it already started (`on_finish`, `on_progress`) until they end.

Levels are strict: a higher level's requests are admitted first, and the levels below get the
KV that is left. The executor sees one `AdmissionPolicy`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

from scheduler.types import AdmissionPolicy, PlanRequest, StepBudget, ahead_of_queue

PolicyFactory = Callable[[list[PlanRequest]], AdmissionPolicy]


class MixPolicy:
    """An `AdmissionPolicy` whose requests arrive over time, at priority levels."""

    name = "mix"

    def __init__(self, build: PolicyFactory) -> None:
        self._build = build
        self._current: dict[int, AdmissionPolicy] = {}  # level -> the policy that admits
        self._owner: dict[str, AdmissionPolicy] = {}  # admitted, running request -> its policy
        self._running: dict[int, int] = {}  # id(policy) -> its requests still running
        self._level_of: dict[str, int] = {}  # request not yet finished -> its level
        self._ahead = 0  # the last admit's requests, from its front, ahead of the queue
        self.replans = 0  # plans rebuilt because requests joined or left

    # ---- arrivals and departures -----------------------------------------------------------
    def add(self, requests: Iterable[PlanRequest], level: int = 0) -> None:
        """Plan `requests` into `level` together with what it has not admitted yet."""
        new = list(requests)
        if not new:
            return
        for r in new:
            self._level_of[r.id] = level
        old = self._current.get(level)
        left = old.withdraw() if old is not None else []
        self.replans += old is not None
        self._current[level] = self._build(left + new)

    def remove(self, request_ids: Iterable[str]) -> None:
        """Forget requests (a cancelled batch): unadmitted ones leave their plan; running ones
        are released as finished (the executor has dropped them)."""
        gone = set(request_ids)
        levels = set()
        for rid in gone:
            level = self._level_of.pop(rid, None)
            if level is None:
                continue
            if rid in self._owner:
                self._finished(rid, 0)
            else:
                levels.add(level)
        for level in levels & self._current.keys():
            left = [r for r in self._current[level].withdraw() if r.id not in gone]
            self.replans += 1
            self._current[level] = self._build(left)
        self._drop_idle()

    # ---- AdmissionPolicy -------------------------------------------------------------------
    def admit(self, budget: StepBudget) -> list[PlanRequest]:
        out: list[PlanRequest] = []
        self._ahead = 0
        for level in sorted(self._current, reverse=True):
            pol = self._current[level]
            taken = pol.admit(budget)
            if taken and not out:  # the first level's critical-path starts lead the answer
                self._ahead = ahead_of_queue(pol)
            for r in taken:
                self._owner[r.id] = pol
            self._running[id(pol)] = self._running.get(id(pol), 0) + len(taken)
            out += taken
            if taken:  # the levels below see the KV and prefill these will take
                prompt = sum(r.prompt_len for r in taken)
                budget = replace(
                    budget,
                    free_kv_tokens=max(budget.free_kv_tokens - prompt, 0),
                    running=budget.running + len(taken),
                    waiting_prefill_tokens=budget.waiting_prefill_tokens + prompt,
                )
        return out

    def ahead_of_queue(self) -> int:
        return self._ahead

    def prefill_budget(self, budget: StepBudget) -> int | None:
        """The pacing of the highest level with work; None (full steps) once levels mix."""
        active = [p for p in self._current.values() if self._busy(p)]
        if len(active) != 1:
            return None
        return active[0].prefill_budget(budget)

    def on_finish(self, request_id: str, output_len: int) -> None:
        self._level_of.pop(request_id, None)
        if request_id in self._owner:
            self._finished(request_id, output_len)
            self._drop_idle()

    def _finished(self, request_id: str, output_len: int) -> None:
        owner = self._owner.pop(request_id)
        owner.on_finish(request_id, output_len)
        left = self._running[id(owner)] - 1
        if left:
            self._running[id(owner)] = left
        else:
            del self._running[id(owner)]

    def _busy(self, pol: AdmissionPolicy) -> bool:
        return pol.has_pending() or id(pol) in self._running

    def _drop_idle(self) -> None:
        """A level with nothing to admit and nothing running is gone (a later add starts it)."""
        self._current = {lvl: p for lvl, p in self._current.items() if self._busy(p)}

    def on_progress(self, request_id: str, generated: int) -> None:
        owner = self._owner.get(request_id)
        if owner is not None:
            owner.on_progress(request_id, generated)

    def has_pending(self) -> bool:
        return any(p.has_pending() for p in self._current.values())

    def withdraw(self) -> list[PlanRequest]:
        out: list[PlanRequest] = []
        for pol in self._current.values():
            out += pol.withdraw()
        for r in out:
            self._level_of.pop(r.id, None)
        return out

    @property
    def pending_ids(self) -> set[str]:
        """Requests added and not yet admitted (tests, metrics)."""
        return {rid for rid in self._level_of if rid not in self._owner}
