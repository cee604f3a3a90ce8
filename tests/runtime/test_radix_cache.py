"""Radix cache over token ids: page-granular matching, splitting, ref counts, eviction (LRU,
what waiting prompts need last)."""

from __future__ import annotations

import random

import pytest

from runtime import radix_cache
from runtime.radix_cache import PageCopies, PrefixDemand, RadixCache, RadixNode, page_hashes

PS = 2


def make_cache() -> tuple[RadixCache, list[int]]:
    freed: list[int] = []
    return RadixCache(PS, freed.extend), freed


def test_match_returns_whole_pages_of_the_longest_cached_prefix() -> None:
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    pages, _ = cache.match_prefix([1, 2, 3, 4, 9, 9, 9])
    assert pages == [10, 11]
    pages, _ = cache.match_prefix([1, 2, 3])  # the partial page does not count
    assert pages == [10]
    assert cache.match_prefix([7, 7])[0] == []


def test_match_respects_max_pages() -> None:
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4], [10, 11])
    assert cache.match_prefix([1, 2, 3, 4], max_pages=1)[0] == [10]


def test_a_partial_match_finds_the_child_sharing_the_longest_run_of_a_page() -> None:
    cache = RadixCache(4, lambda pages: None)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    cache.insert([1, 2, 3, 4, 5, 9, 9, 9], [10, 12])
    cache.insert([1, 2, 3, 4, 5, 6, 9, 9], [10, 13])
    pages, node = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 0])
    assert pages == [10]
    holder, n = cache.match_partial(node, [1, 2, 3, 4, 5, 6, 7, 0], 1, 3)  # type: ignore[misc]
    assert (holder.pages[0], n) == (11, 3)  # [5, 6, 7] of [5, 6, 7, 8]
    assert cache.match_partial(node, [1, 2, 3, 4, 5, 6, 7], 1, 2)[1] == 2  # type: ignore[index]
    assert cache.match_partial(node, [1, 2, 3, 4, 5, 6, 7, 8, 0], 1, 9)[1] == 3  # < a page
    assert cache.match_partial(node, [1, 2, 3, 4, 7, 7], 1, 2) is None  # no token in common


def test_a_partial_match_skips_a_node_with_too_many_children(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cache, _ = make_cache()
    for i in range(3):
        cache.insert([1, 2, 3, i], [10, 20 + i])
    _, node = cache.match_prefix([1, 2, 3, 9])  # [1, 2], then 3 begins each of 3 children
    assert cache.match_partial(node, [1, 2, 3, 9], 1, 1) is not None
    monkeypatch.setattr(radix_cache, "PARTIAL_SCAN", 2)
    assert cache.match_partial(node, [1, 2, 3, 9], 1, 1) is None


def test_page_copies_hold_their_source_until_done_and_cancel_by_destination() -> None:
    cache, freed = make_cache()
    cache.insert([1, 2, 3, 4], [10, 11])
    node = cache.match_prefix([1, 2, 3, 9])[1]
    copies = PageCopies(cache)
    pages = iter([30, 31])
    assert copies.share(node, [1, 2, 3, 9], 1, 1, lambda: next(pages)) == (30, 1)
    assert copies.share(node, [1, 2, 3, 8], 1, 1, lambda: next(pages)) == (31, 1)
    assert copies.share(node, [1, 2, 3, 7], 1, 1, lambda: None) is None  # no room: no copy
    assert copies.batch() == [(11, 30, 0, 1), (11, 31, 0, 1)]
    copies.cancel([30])
    assert copies.batch() == [(11, 31, 0, 1)]
    assert cache.evict(2) == 0  # still held for the copy into 31
    copies.done()
    assert copies.batch() == [] and cache.evict(2) == 2 and sorted(freed) == [10, 11]


def test_a_page_still_being_copied_into_gives_its_copied_slots_from_their_source() -> None:
    cache = RadixCache(4, lambda pages: None)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], [10, 11])
    copies = PageCopies(cache)
    node = cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0])[1]
    assert copies.share(node, [1, 2, 3, 4, 5, 6, 0, 0], 1, 3, lambda: 30) == (30, 2)
    cache.insert([1, 2, 3, 4, 5, 6, 9, 9], [10, 30])  # its prefill fills page 30 this step
    assert copies.share(node, [1, 2, 3, 4, 5, 6, 9, 0], 1, 3, lambda: 31) == (31, 3)
    # page 30's slots 0, 1 arrive from page 11 in the same pass: read them there
    assert copies.batch() == [(11, 30, 0, 2), (11, 31, 0, 2), (30, 31, 2, 3)]
    copies.done()
    assert all(n.ref == 0 for n in cache.nodes())


def test_insert_reports_the_already_cached_pages() -> None:
    cache, _ = make_cache()
    assert cache.insert([1, 2, 3, 4], [10, 11])[0] == 0
    n, _ = cache.insert([1, 2, 3, 4, 5, 6], [20, 21, 22])
    assert n == 2  # the caller frees its duplicates 20, 21
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[0] == [10, 11, 22]
    assert cache.total_pages == 3


def test_diverging_insert_splits_a_node() -> None:
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    cache.insert([1, 2, 7, 8], [10, 30])
    assert cache.match_prefix([1, 2, 7, 8])[0] == [10, 30]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[0] == [10, 11, 12]
    assert len(cache.nodes()) == 3


def test_locked_pages_are_not_evicted_and_unlocked_leaves_go_oldest_first() -> None:
    cache, freed = make_cache()
    cache.insert([1, 1, 1, 1], [10, 11])
    cache.insert([2, 2], [20])
    cache.insert([3, 3], [30])
    _, node = cache.match_prefix([1, 1, 1, 1])  # touch: 1-branch is now the newest
    cache.lock(node)
    assert cache.evictable_pages == 2
    assert cache.evict(1) == 1 and freed == [20]
    assert cache.evict(10) == 1 and freed == [20, 30]
    assert cache.match_prefix([1, 1, 1, 1])[0] == [10, 11]
    cache.unlock(node)
    assert cache.evictable_pages == 2
    assert cache.evict(10) == 2 and sorted(freed) == [10, 11, 20, 30]
    assert cache.total_pages == 0 and cache.nodes() == []


def test_evicting_a_leaf_makes_its_parent_evictable() -> None:
    cache, freed = make_cache()
    cache.insert([1, 1, 2, 2], [10, 11])
    cache.insert([1, 1, 3, 3], [10, 12])
    assert cache.evict(3) == 3 and sorted(freed) == [10, 11, 12]


def test_split_keeps_lock_counts_consistent() -> None:
    cache, _ = make_cache()
    cache.insert([1, 2, 3, 4], [10, 11])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.lock(node)
    _, upper = cache.match_prefix([1, 2, 9, 9])  # splits the locked node
    assert upper.ref == 1 and cache.evictable_pages == 0
    cache.unlock(node)
    assert cache.evictable_pages == 2


def test_leaves_a_waiting_prompt_begins_with_are_evicted_after_the_others() -> None:
    cache, freed = make_cache()
    cache.insert([1, 1, 2, 2], [10, 11])  # oldest: a waiting prompt continues it
    cache.insert([3, 3], [30])
    cache.insert([4, 4], [40])
    cache.demand.add([1, 1, 2, 2, 5])
    assert cache.evict(1) == 1 and freed == [30]  # the oldest unwanted leaf, not the oldest
    assert cache.evict(1) == 1 and freed == [30, 40]
    assert cache.evict(1) == 2 and freed == [30, 40, 10, 11]  # then the wanted ones, LRU


def test_a_prompt_that_shares_only_a_nodes_first_page_still_wants_it() -> None:
    cache, freed = make_cache()
    cache.insert([1, 1, 2, 2], [10, 11])
    cache.insert([3, 3], [30])
    cache.demand.add([1, 1, 9, 9])  # would split the node: its first page is worth keeping
    assert cache.evict(1) == 1 and freed == [30]
    cache.demand.add([1, 1, 9, 9], -1)  # it left without starting: plain LRU again
    cache.rekey()
    cache.insert([4, 4], [40])
    assert cache.evict(1) == 2 and freed == [30, 10, 11]


def test_a_prompt_that_starts_locks_what_it_wanted_and_frees_it_to_lru() -> None:
    cache, freed = make_cache()
    cache.insert([1, 1, 2, 2], [10, 11])
    cache.insert([3, 3], [30])
    cache.demand.add([1, 1, 2, 2, 5])
    _, node = cache.match_prefix([1, 1, 2, 2, 5])  # it starts: the engine locks the prefix
    cache.demand.add([1, 1, 2, 2, 5], -1)
    cache.lock(node)
    cache.insert([4, 4], [40])
    cache.unlock(node)  # finished, and nobody waits for its prefix: LRU ranks it again
    assert cache.evict(1) == 1 and freed == [30]
    assert cache.evict(1) == 2 and freed == [30, 10, 11]  # used before [4, 4] was cached
    assert cache.evict(1) == 1 and freed == [30, 10, 11, 40]


def test_a_split_node_keeps_its_path_hash() -> None:
    cache, freed = make_cache()
    cache.insert([1, 1, 2, 2, 3, 3], [10, 11, 12])
    cache.insert([5, 5], [50])
    cache.demand.add([1, 1, 2, 2, 3, 3, 7])
    assert cache.evict(1) == 1 and freed == [50]  # hashes the path before the split below
    cache.match_prefix([1, 1, 8, 8])  # splits [1 1 | 2 2 3 3]
    cache.insert([6, 6], [60])
    assert cache.evict(1) == 1 and freed == [50, 60]  # the lower part is still wanted


def test_demand_counts_each_waiting_prompt() -> None:
    demand = PrefixDemand(PS)
    demand.add([1, 1, 2])
    demand.add([1, 1, 3, 3])
    first, second = page_hashes([1, 1, 3, 3], PS)
    demand.add([1, 1, 2], -1)
    assert demand.wants(first) and demand.wants(second)  # the other prompt still waits
    demand.add([1, 1, 3, 3], -1)
    assert not demand.wants(first) and not demand.wants(second)


def test_repeated_locking_frees_each_page_once() -> None:
    cache, freed = make_cache()
    cache.insert([1, 1, 2, 2], [10, 11])
    _, node = cache.match_prefix([1, 1, 2, 2])
    for _ in range(1000):  # each unlock offers the leaf again
        cache.lock(node)
        cache.unlock(node)
    cache.insert([3, 3], [30])
    assert cache.evict(10) == 3 and sorted(freed) == [10, 11, 30]
    assert cache.evict(10) == 0 and cache.total_pages == 0


def _path_first_hash(node: RadixNode) -> int:
    keys = []
    n = node.parent
    while n is not None and n.key:
        keys.append(n.key)
        n = n.parent
    path = [t for key in reversed(keys) for t in key] + node.key[:PS]
    *_, h = page_hashes(path, PS)
    return h


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_eviction_takes_the_leaf_a_full_ranking_would(seed: int) -> None:
    # The candidates are kept lazily; every single-leaf eviction must still pick the unlocked
    # leaf that ranks first by (wanted by a waiting prompt, last access), as a fresh scan would.
    rng = random.Random(seed)
    cache, freed = make_cache()
    locked: list[RadixNode] = []
    waiting: list[list[int]] = []
    next_page = 0
    for _ in range(400):
        op = rng.random()
        tokens = [rng.randrange(1, 4) for _ in range(2 * rng.randrange(1, 5))]
        if op < 0.35:
            n = len(tokens) // PS
            cache.insert(tokens, list(range(next_page, next_page + n)))
            next_page += n
        elif op < 0.5:
            _, node = cache.match_prefix(tokens)
            if node is not cache.root:
                cache.lock(node)
                locked.append(node)
        elif op < 0.6 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.7:
            cache.demand.add(tokens)
            waiting.append(tokens)
        elif op < 0.75 and waiting:
            cache.demand.add(waiting.pop(rng.randrange(len(waiting))), -1)
            cache.rekey()
        else:
            leaves = [n for n in cache.nodes() if not n.children and n.ref == 0]
            if not leaves:
                continue
            best = min(leaves, key=lambda n: (cache.demand.wants(_path_first_hash(n)),
                                              n.last_access, id(n)))
            before = len(freed)
            assert cache.evict(1) == len(best.pages)
            assert freed[before:] == best.pages
    assert cache.evictable_pages + sum(len(n.pages) for n in cache.nodes() if n.ref) \
        == cache.total_pages
