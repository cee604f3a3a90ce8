"""Output lengths a running batch shows: samples the plan can learn from (BlendPolicy re-plans
from them, when blending, each time they have grown RUN_LEARN_GROWTH-fold), and the survival of
lengths relative to their estimates, which forecasts the KV the running requests will hold
(memory.KvForecast, where compute and memory do not overlap)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

RUN_LEARN_GROWTH = 2.0  # re-plan from the run's lengths once they are this many times the last's
RUN_LEARN_RUNNING = 0.1  # ... and at most this share of them still run
EARLY_ENDS = 4  # outputs ended by the model, and
EARLY_SHARE = 0.2  # ... this share of the requests started, before lengths are not max_tokens
SURVIVAL_MIN_EVENTS = 16  # outputs ended by the model before their survival is trusted


class RunLengths:
    """When each request started and on what length estimate, and how long the finished ones
    of unknown length ran."""

    def __init__(self, known_lens: np.ndarray, max_tokens: np.ndarray) -> None:
        self._unknown = np.asarray(known_lens) < 0
        self._max = np.asarray(max_tokens, dtype=np.int64)
        self._start = np.full(len(self._unknown), -1, dtype=np.int64)  # the step it started
        self._basis = np.ones(len(self._unknown))  # its length estimate when it started
        self._length = np.full(len(self._unknown), -1, dtype=np.int64)  # finished: its length
        self._finished = 0  # requests of unknown length finished
        self._ended = 0  # ... of which before max_tokens: the model ended them
        self._longest = 0  # longest output finished so far
        self._next_look = 0  # finished count at which the samples are worth counting again

    def started(self, req: int, step: int, estimate: float) -> None:
        self._start[req] = step
        self._basis[req] = max(float(estimate), 1.0)

    def basis(self, reqs: np.ndarray) -> np.ndarray:
        """The length estimates the requests `reqs` started with."""
        return self._basis[reqs]

    def finished(self, req: int, length: int) -> None:
        if self._unknown[req]:
            self._length[req] = length
            self._finished += 1
            self._ended += length < self._max[req]
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

    @property
    def may_all_run_to_max(self) -> bool:
        """Whether the run has yet to show outputs ending before max_tokens: fewer than
        EARLY_ENDS of unknown length ended on their own, or fewer than EARLY_SHARE of those
        started, and too few for `survival`. Until then every output may run to max_tokens (a
        batch where most do shows a few early ends at most: SmolLM2, 15 of 144)."""
        started = np.count_nonzero(self._unknown & (self._start >= 0))
        return self._ended < max(EARLY_ENDS, EARLY_SHARE * started) and not self.survival_known

    @property
    def survival_known(self) -> bool:
        """Whether SURVIVAL_MIN_EVENTS outputs have ended on their own (`survival` says more
        than nothing)."""
        return self._ended >= SURVIVAL_MIN_EVENTS

    def survival(self, running: np.ndarray, generated: np.ndarray) -> Survival | None:
        """Kaplan-Meier survival of output length in units of each request's estimate when it
        started: a finished output is an event at its length (one that reached max_tokens is
        censored there: the model might have gone on), a running request (`running`, having
        generated `generated` tokens) is censored there. Censoring is what keeps survivor bias
        out: the requests that finished first are the short ones. None until
        `survival_known`."""
        if not self.survival_known:
            return None
        done = np.flatnonzero(self._length >= 0)
        run = self._unknown[running]
        reqs = np.asarray(running)[run]
        times = np.concatenate((self._length[done] / self._basis[done],
                                np.asarray(generated, dtype=np.float64)[run] / self._basis[reqs]))
        ended = np.concatenate((self._length[done] < self._max[done], np.zeros(len(reqs), bool)))
        return Survival.kaplan_meier(times, ended)


class Survival:
    """A survival function S(x) = P(length > x), a step function falling at event times."""

    def __init__(self, times: np.ndarray, values: np.ndarray) -> None:
        self._times = times  # ascending event times
        self._values = values  # S just after each

    @classmethod
    def kaplan_meier(cls, times: np.ndarray, ended: np.ndarray) -> Survival:
        """Product over event times t_k of (1 − d_k/n_k): d_k ended at t_k, n_k at risk (ended or
        censored at t_k or later)."""
        order = np.sort(times)
        at, died = np.unique(times[ended], return_counts=True)
        at_risk = len(order) - np.searchsorted(order, at, side="left")
        return cls(at, np.cumprod(1.0 - died / np.maximum(at_risk, 1)))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(self._times, x, side="right")
        values = np.concatenate(([1.0], self._values))  # S = 1 before the first event
        return values[k]
