"""The paged KV pool: one preallocated tensor per layer, fixed-size pages, a free-list allocator.

Everything above this module speaks in page ids; a token's slot is `page * page_size + offset`.
The pool never grows after start-up, so memory stays flat however many requests pass through.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from runtime.errors import OutOfKVPages

DEFAULT_KV_FRACTION = 0.10  # of physical RAM, when no budget is given on CPU
DEFAULT_KV_CAP_BYTES = 2 << 30  # 2 GiB
PAGE_ALIGN = 4096  # the CPU pool's start: aligned as torch's own allocations (64) and more
GPU_KV_FRACTION = 0.85  # of the GPU memory free once the weights are loaded (the rest: activations)


def default_kv_memory_bytes(device: str = "cpu") -> int:
    """On a GPU, 85% of its free memory (call after loading the weights); on a CPU, 10% of
    RAM capped at 2 GiB: enough for a few hundred chat requests of a small model."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free * GPU_KV_FRACTION)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return int(min(ram * DEFAULT_KV_FRACTION, DEFAULT_KV_CAP_BYTES))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On a CPU from calloc (numpy's zeros): the OS hands out zero pages as they
    are first touched, so a run pays only for the pages it uses, where torch.zeros writes every
    byte at start-up (the default 2 GiB pool: a one-request `blendserve run` took 3.0-3.4 s,
    now 1.6-2.0 s, on a 2-core Zen 5). numpy asks for transparent huge pages on it (madvise).

    The first write of a page is not free on the project's VMs: a 16 x 512-token prefill step on
    pages never used took 2.5-2.7 s, on pages used before 2.1-2.2 s (2-core Xeon, 2026-12-05),
    and a run pays it for every page it fills. Backing the whole pool before the run
    (MADV_POPULATE_WRITE, 5.3 s for the 2 GiB) made the chat and low_sharing runs 2-8% faster
    but only moves that cost to start-up; writing pages ahead of use from the scheduling thread
    (256 pages at a time) left whole runs as they were. So the cost is modelled instead: the
    pool counts the pages it hands out for the first time (`pages_ever_taken`, each step's
    `fresh_kv`), the profile times a first write (profile.fresh_kv_seconds) and the simulator
    charges it for every KV token written until the pool is full."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + PAGE_ALIGN, dtype=np.uint8)  # calloc's pointer is 16 bytes past a page
    start = -raw.ctypes.data % PAGE_ALIGN
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


class PagedKVPool:
    """K and V for every layer in pages of `page_size` tokens, plus the free list of pages."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"a KV pool needs at least one page of at least one slot, not "
                             f"{num_pages} pages of {page_size}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        # data: [layers, 2 (K|V), pages, page_size, kv_heads, head_dim]; zeros, not empty, so that
        # padded gathers read finite numbers.
        self.data = _zeros((num_layers, 2, num_pages, page_size, kv_heads, head_dim), dtype,
                           torch.device(device))
        self.k = [self.data[i, 0] for i in range(num_layers)]  # each [pages, ps, kvh, hd]
        self.v = [self.data[i, 1] for i in range(num_layers)]
        # Pop from the end: low page ids go out first (nicer to read in tests).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._untouched = 0  # pages from here on have never been taken

    @staticmethod
    def bytes_per_page(
        *, num_layers: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * num_layers * page_size * kv_heads * head_dim * elem

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def alloc(self, n: int) -> list[int]:
        """Take `n` pages; raises OutOfKVPages (taking none) when fewer are free."""
        if n > len(self._free):
            raise OutOfKVPages(f"need {n} pages, {len(self._free)} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        self._untouched = max(self._untouched, max(out) + 1)
        return out

    def alloc_fresh(self, n: int) -> list[int] | None:
        """Take `n` pages never taken before (None where fewer are left): the profile times a
        KV page's first write on them."""
        left = self.num_pages - self._untouched  # the free list's first entries, descending
        if n > left or n <= 0:
            return None
        out = self._free[left - n:left]
        del self._free[left - n:left]
        self._untouched += n
        return out

    @property
    def pages_ever_taken(self) -> int:
        """Pages handed out at least once: ids 0 .. this - 1, since pages go out in ascending
        order until freed ones come back (so it grows by the fresh pages an alloc takes, whose
        first write costs more, see _zeros)."""
        return self._untouched

    def write_fresh(self, since: int) -> None:
        """Write zeros over the pages first handed out since `pages_ever_taken` was `since`, so
        that the OS backs them now and not in the first step that reads or writes them (the
        profile's step shapes read their K/V as a run's decodes do, after a prefill wrote it)."""
        if self._untouched > since:
            self.data[:, :, since:self._untouched].zero_()

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page's K/V in every layer (forking a sequence whose last page is partial)."""
        self.data[:, :, dst].copy_(self.data[:, :, src])
