"""Output lengths a running batch shows, as samples the plan can learn from (BlendPolicy
re-plans from them, when blending, each time they have grown RUN_LEARN_GROWTH-fold)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

RUN_LEARN_GROWTH = 2.0  # re-plan from the run's lengths once they are this many times the last's
RUN_LEARN_RUNNING = 0.1  # ... and at most this share of them still run


class RunLengths:
    """When each request started and how long the finished ones of unknown length ran."""

    def __init__(self, known_lens: np.ndarray) -> None:
        self._unknown = np.asarray(known_lens) < 0
        self._start = np.full(len(self._unknown), -1, dtype=np.int64)  # the step it started
        self._length = np.full(len(self._unknown), -1, dtype=np.int64)  # finished: its length
        self._finished = 0  # requests of unknown length finished
        self._longest = 0  # longest output finished so far
        self._next_look = 0  # finished count at which the samples are worth counting again

    def started(self, req: int, step: int) -> None:
        self._start[req] = step

    def finished(self, req: int, length: int) -> None:
        if self._unknown[req]:
            self._length[req] = length
            self._finished += 1
            self._longest = max(self._longest, length)

    def due(self) -> bool:
        """Whether enough have finished since the last look (a quarter more, at least 16) for
        the samples to be counted again; a True moves the next look on."""
        if self._finished < self._next_look:
            return False
        self._next_look = self._finished + max(self._finished // 4, 16)
        return True

    def samples(self, step: int, running: Mapping[int, float]) -> dict[int, int]:
        """Lengths free of survivor bias: every request of unknown length that started at least
        as many steps before `step` as the longest output finished so far, at its length, or,
        still running, at its estimate in `running` (raised past what it has generated,
        `corrected_estimate`); none while more than RUN_LEARN_RUNNING of them still run. Later
        starts are left out: among them the short ones finish first. Early on, when only short
        outputs have finished, most of the requests old enough still run, and their estimates
        are the plan's own guesses: learning from them fed a low guess back (600 requests of 10,
        10 and 1,000 tokens in turn, planned at 256, then 247, 89, 69 and 332; true mean 340)."""
        old = np.flatnonzero(self._unknown & (self._start >= 0)
                             & (self._start <= step - self._longest))
        done = old[self._length[old] >= 0]
        out = dict(zip(done.tolist(), self._length[done].tolist()))
        for i in old[self._length[old] < 0].tolist():
            if i in running:
                out[i] = int(running[i])
        if len(out) - len(done) > RUN_LEARN_RUNNING * len(out):
            return {}  # too many would be the plan's own guesses
        return out
