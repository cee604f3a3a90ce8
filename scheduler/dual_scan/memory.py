"""The memory-side arithmetic of the dual scan: how a step's KV splits between the cursors,
the steady-state prefill of a side, and the KV peak of a set of running requests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class MemorySplit:
    """One step's view of the two cursors: densities, memory shares and steady-state prefill."""

    rho_left: float
    rho_right: float
    rho_target: float
    mem_left: float  # KV tokens of the left (compute-heavy) side
    mem_right: float
    prefill_left: float  # DESIGN.md steady state C = N·p̄/d̄ of each side, tokens per step
    prefill_right: float


def split_memory(
    rho_left: float, rho_right: float, rho_target: float, capacity: float
) -> tuple[float, float]:
    """M_L = M·(ρ_t − ρ_R)/(ρ_L − ρ_R) clamped to [0, M]; all to the left when densities tie."""
    if not rho_left > rho_right:
        return float(capacity), 0.0
    share = (rho_target - rho_right) / (rho_left - rho_right)
    m_left = float(capacity) * min(1.0, max(0.0, share))
    return m_left, float(capacity) - m_left


def steady_prefill(mem_tokens: float, mean_computed: float, mean_output: float) -> float:
    """C = N·p̄/d̄ with N = M/(p̄ + d̄/2): prefill that replaces a side's finishers each step."""
    if mem_tokens <= 0 or mean_output <= 0:
        return 0.0
    n = mem_tokens / max(mean_computed + mean_output / 2.0, 1.0)
    return n * mean_computed / mean_output


class KvPeak:
    """The most KV a set of running requests will hold: request i holds c_i + t tokens until
    it finishes r_i steps from now, so with r sorted descending the peak is
    max_k (c_1 + … + c_k + k·r_k), just before the k-th longest finishes."""

    def __init__(self, held: np.ndarray, left: np.ndarray) -> None:
        order = np.argsort(-left, kind="stable")
        self._held = held[order]  # c: KV held now, by remaining steps, descending
        self._left = left[order]  # r

    def _insert(self, held: float, left: float) -> tuple[np.ndarray, np.ndarray]:
        k = int(np.searchsorted(-self._left, -left, side="right"))
        return np.insert(self._held, k, held), np.insert(self._left, k, left)

    @staticmethod
    def _peak(held: np.ndarray, left: np.ndarray) -> float:
        if len(left) == 0:
            return 0.0
        return float(np.max(np.cumsum(held) + np.arange(1, len(left) + 1) * left))

    def with_request(self, held: float, left: float) -> float:
        """The peak if a request holding `held` tokens now and decoding `left` more joins."""
        return self._peak(*self._insert(held, left))

    def value(self) -> float:
        """The peak of the requests as they are (0 for none)."""
        return self._peak(self._held, self._left)

    def add(self, held: float, left: float) -> None:
        self._held, self._left = self._insert(held, left)
