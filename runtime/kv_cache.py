"""The paged KV pool: one preallocated tensor per layer, fixed-size pages, a free-list allocator.

Everything above this module speaks in page ids; a token's slot is `page * page_size + offset`.
The pool never grows after start-up, so memory stays flat however many requests pass through.
"""

from __future__ import annotations

import os

import torch

from runtime.errors import OutOfKVPages

DEFAULT_KV_FRACTION = 0.10  # of physical RAM, when no budget is given on CPU
DEFAULT_KV_CAP_BYTES = 2 << 30  # 2 GiB
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
        self.data = torch.zeros(
            (num_layers, 2, num_pages, page_size, kv_heads, head_dim), dtype=dtype, device=device
        )
        self.k = [self.data[i, 0] for i in range(num_layers)]  # each [pages, ps, kvh, hd]
        self.v = [self.data[i, 1] for i in range(num_layers)]
        # Pop from the end: low page ids go out first (nicer to read in tests).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

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
        return out

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page's K/V in every layer (forking a sequence whose last page is partial)."""
        self.data[:, :, dst].copy_(self.data[:, :, src])
