"""Paged KV pool: allocation, freeing, sizing from a byte budget."""

from __future__ import annotations

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
