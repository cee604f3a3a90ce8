"""The attention backend interface and registry (`torch` everywhere, `flashinfer` on CUDA).

A backend is planned once per engine step from an `AttentionBatch` (plain lists describing the
flat token batch) and then called once per layer; everything per-sequence happens in `plan`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

import torch

from runtime.errors import UnknownAttentionBackend
from runtime.kv_cache import PagedKVPool


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    """One step's sequences in flat-batch order.

    Invariant: the decodes (q_len == 1) come first, then the prefill chunks (a prompt's last
    token may be a chunk of one), and the flat token batch holds each sequence's new tokens
    contiguously in that same order.
    """

    q_lens: Sequence[int]  # new tokens of each sequence this step
    kv_lens: Sequence[int]  # context length after this step (cached + new), >= q_len
    page_tables: Sequence[Sequence[int]]  # pages holding each sequence's context, in order
    num_decode: int  # how many leading sequences decode (q_len == 1)
    # (src page, dst page, lo, hi): copy slots lo .. hi - 1 of src into dst in every layer, after
    # the step's new K/V are written and before attending (shared partial pages: PageCopies)
    page_copies: Sequence[tuple[int, int, int, int]] = ()


class AttentionBackend(ABC):
    """Writes the step's new K/V into the paged pool and attends over each sequence's pages."""

    name: str = ""
    copies_pages = False  # whether forward does AttentionBatch.page_copies

    def __init__(self, pool: PagedKVPool, *, num_heads: int, scale: float) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.scale = scale

    @property
    def cascades(self) -> bool:
        """Whether decodes sharing leading pages attend to them once per group (and the step
        counts those pages once)."""
        return False

    @abstractmethod
    def plan(self, batch: AttentionBatch, slot: int = 0) -> Any:
        """Build the index tensors of one step (called once per step, not per layer). Plans that
        are alive at once (the two halves of an overlapped step) are made on different slots;
        a backend whose plans own all their buffers ignores `slot`."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any
    ) -> torch.Tensor:
        """q: [T, heads, hd], k/v: [T, kv_heads, hd] -> attention output [T, heads * hd]."""


_REGISTRY: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def make_backend(name: str, pool: PagedKVPool, *, num_heads: int, scale: float) -> AttentionBackend:
    if name not in _REGISTRY:
        raise UnknownAttentionBackend(f"unknown attention backend {name!r}; have {sorted(_REGISTRY)}")
    return _REGISTRY[name](pool, num_heads=num_heads, scale=scale)


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def resolve_backend(name: str, device: str) -> str:
    """`auto`: flashinfer on a CUDA device when the package is installed, else torch."""
    if name != "auto":
        return name
    if device.startswith("cuda") and find_spec("flashinfer") is not None:
        return "flashinfer"
    return "torch"
