"""Paged KV pool: allocation, freeing, sizing from a byte budget."""

from __future__ import annotations

import os

import pytest
import torch

from runtime.errors import OutOfKVPages
from runtime.kv_cache import PagedKVPool, default_kv_memory_bytes


def make_pool(pages: int = 8) -> PagedKVPool:
    return PagedKVPool(num_layers=2, num_pages=pages, page_size=4, kv_heads=2, head_dim=8,
                       dtype=torch.float32)


def test_alloc_and_free_round_trip_keeps_every_page() -> None:
    pool = make_pool(8)
    a = pool.alloc(3)
    b = pool.alloc(5)
    assert pool.num_free == 0 and sorted(a + b) == list(range(8))
    pool.free(a)
    assert pool.num_free == 3 and sorted(pool.alloc(3)) == sorted(a)


def test_alloc_beyond_free_raises_and_takes_nothing() -> None:
    pool = make_pool(4)
    pool.alloc(3)
    with pytest.raises(OutOfKVPages):
        pool.alloc(2)
    assert pool.num_free == 1


def test_per_layer_views_share_one_buffer_and_copy_page_copies_all_layers() -> None:
    pool = make_pool(4)
    assert pool.k[1].shape == (4, 4, 2, 8)
    pool.k[1][2].fill_(3.0)
    pool.v[0][2].fill_(5.0)
    pool.copy_page(2, 0)
    assert torch.all(pool.k[1][0] == 3.0) and torch.all(pool.v[0][0] == 5.0)
    assert pool.data[1, 0, 2].data_ptr() == pool.k[1][2].data_ptr()


def test_bytes_per_page_matches_the_allocation() -> None:
    per = PagedKVPool.bytes_per_page(num_layers=2, page_size=4, kv_heads=2, head_dim=8,
                                     dtype=torch.bfloat16)
    pool = PagedKVPool(num_layers=2, num_pages=3, page_size=4, kv_heads=2, head_dim=8,
                       dtype=torch.bfloat16)
    assert per * 3 == pool.data.numel() * pool.data.element_size()
    assert pool.capacity_tokens == 12


def test_default_budget_is_positive_and_capped() -> None:
    b = default_kv_memory_bytes()
    assert 0 < b <= 2 << 30


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_cpu_pool_is_zero_aligned_and_takes_memory_only_where_it_is_written() -> None:
    """The pool comes from calloc: zeros the OS hands out as pages are first touched, so a
    512 MiB pool costs nothing at start-up and a run's memory is the KV it uses."""
    before = _rss_bytes()
    pool = PagedKVPool(num_layers=8, num_pages=4096, page_size=16, kv_heads=4, head_dim=64,
                       dtype=torch.bfloat16)  # 512 MiB
    assert pool.data.numel() * 2 == 512 << 20 and pool.data.is_contiguous()
    assert pool.data.data_ptr() % 4096 == 0
    assert _rss_bytes() - before < 64 << 20
    pool.k[7][4095].fill_(1.0)
    assert pool.data.count_nonzero().item() == 16 * 4 * 64  # the rest reads as zeros
    data = pool.data
    del pool
    assert data[7, 0, 4095].float().sum().item() == 16 * 4 * 64  # the tensor owns the memory


def test_writing_the_fresh_pages_writes_only_those_handed_out_since() -> None:
    pool = make_pool(8)
    pool.data.fill_(1.0)  # stands for K/V the pages hold
    since = pool.pages_ever_taken
    a = pool.alloc(3)
    pool.write_fresh(since)
    assert pool.data[:, :, :3].count_nonzero().item() == 0
    assert pool.data[:, :, 3:].eq(1.0).all()  # pages not handed out are left as they are
    pool.data[:, :, a] = 2.0
    pool.free(a)
    since = pool.pages_ever_taken
    b = pool.alloc(4)  # the three freed ones again, then one never taken: only that one
    pool.write_fresh(since)
    assert sorted(b) == [0, 1, 2, 3]
    assert pool.data[:, :, :3].eq(2.0).all() and pool.data[:, :, 3].count_nonzero().item() == 0


def test_pages_never_taken_before_count_as_fresh_once() -> None:
    pool = make_pool(8)
    a = pool.alloc(3)
    assert pool.pages_ever_taken == 3
    pool.free(a)
    b = pool.alloc(4)  # the three freed ones come back first, then one never taken
    assert sorted(b) == [0, 1, 2, 3] and pool.pages_ever_taken == 4
    fresh = pool.alloc_fresh(2)  # past the pages handed out so far, in order
    assert sorted(fresh) == [4, 5] and pool.pages_ever_taken == 6
    assert pool.alloc_fresh(3) is None and pool.num_free == 2  # only 6 and 7 never taken
    pool.free(b + fresh)
    assert sorted(pool.alloc(8)) == list(range(8)) and pool.pages_ever_taken == 8
