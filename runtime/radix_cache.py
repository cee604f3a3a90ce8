"""A radix tree over token ids mapping cached prefixes to KV pages (SGLang's RadixCache, paged).

Keys are whole pages: a node's key is a run of tokens whose length is a multiple of page_size
and its `pages` hold their K/V. Requests lock the path they use (ref counts up to the root);
unlocked leaves are evicted least-recently-used first when the pool runs out of pages, those
no waiting prompt begins with (`PrefixDemand`) before those some waiting prompt still needs:
an offline batch knows every prompt it will run, and a warm-up sample's prefixes would
otherwise be the oldest leaves when their subtrees' turn comes. The candidates live in a heap
kept as leaves become unlocked (an eviction costs O(log n), not a scan of every leaf).

A prompt whose cached prefix ends inside a page still shares it to the token (`match_partial`,
`PageCopies`): it starts with a page of its own whose leading slots are copied from the cached
page that holds them, where a whole-page cache (SGLang's and vLLM's with pages of 16) would
compute up to 15 shared tokens again in every request (6.5% of the chat bench's prefill).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

PARTIAL_SCAN = 1024  # match_partial looks through at most this many children of a node


@dataclass(eq=False)
class RadixNode:
    key: list[int]  # tokens, len == len(pages) * page_size
    pages: list[int]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # by first page
    ref: int = 0  # requests currently using this node (or a descendant)
    last_access: int = 0
    first_hash: int | None = None  # page_hashes of the path through this node's first page
    end_hash: int | None = None  # ... through its last page (both memoised when first asked)


def page_hashes(tokens: Sequence[int], page_size: int, start: int = 0) -> Iterator[int]:
    """A running hash per whole page of `tokens`: the k-th names the first k + 1 pages (after
    the path `start` names). Equal prefixes hash equal; a collision only misorders eviction."""
    h = start
    for a in range(0, len(tokens) - page_size + 1, page_size):
        h = hash((h, tuple(tokens[a : a + page_size])))
        yield h


class PrefixDemand:
    """Prompts still waiting to start, counted per page-aligned prefix."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._count: Counter[int] = Counter()

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Count a waiting prompt (`sign` −1: it started or left)."""
        for h in page_hashes(tokens, self.page_size):
            self._count[h] += sign
            if self._count[h] <= 0:
                del self._count[h]

    def __len__(self) -> int:
        """Page prefixes some waiting prompt begins with."""
        return len(self._count)

    def wants(self, prefix_hash: int) -> bool:
        return prefix_hash in self._count

    def clear(self) -> None:
        self._count.clear()


class RadixCache:
    """Prefix tree of cached pages; owns every page in it and hands evicted ones to `free_pages`."""

    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None]) -> None:
        self.page_size = page_size
        self._free_pages = free_pages
        self.demand = PrefixDemand(page_size)  # the engine counts waiting prompts in it
        self._clock = itertools.count(1)
        self.root = RadixNode(key=[], pages=[], parent=None, ref=1, end_hash=0)
        self.evictable_pages = 0  # pages in nodes with ref == 0
        self.total_pages = 0
        # Eviction candidates (wanted, last access, id, node), kept as nodes become unlocked
        # leaves; an entry gone stale (locked, no longer a leaf, evicted, key changed) is
        # dropped or re-keyed when it comes up, and the heap is rebuilt when mostly stale.
        self._heap: list[tuple[bool, int, int, RadixNode]] = []

    # ---- lookup -------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int], max_pages: int | None = None) -> tuple[list[int], RadixNode]:
        """Pages of the longest cached prefix of `tokens` (whole pages, at most max_pages)."""
        ps = self.page_size
        limit = len(tokens) // ps if max_pages is None else min(max_pages, len(tokens) // ps)
        node, pages, i = self.root, [], 0  # i: pages matched so far
        now = next(self._clock)
        node.last_access = now
        while i < limit:
            child = node.children.get(tuple(tokens[i * ps : (i + 1) * ps]))
            if child is None:
                break
            n = self._match_pages(child, tokens, i, limit)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            i += n
            node = child
        return pages, node

    def match_partial(self, node: RadixNode, tokens: Sequence[int], start: int,
                      limit: int) -> tuple[RadixNode, int] | None:
        """Past `match_prefix`'s whole pages (`node`, `start` pages): the child of `node` whose
        first page begins with the longest run of tokens[start * page_size:], 1 .. min(limit,
        page_size - 1) tokens, and that run's length; None if no child shares a token (or
        `node` has too many children to look through). The child's first page holds the K/V
        of that run, followed by a prompt that went on differently."""
        a = start * self.page_size
        want = tokens[a : a + min(limit, self.page_size - 1)]
        if not want or not 0 < len(node.children) <= PARTIAL_SCAN:
            return None
        best, best_n = None, 0
        for first, child in node.children.items():
            if first[0] != want[0]:
                continue
            n = 0
            for x, y in zip(want, child.key):
                if x != y:
                    break
                n += 1
            if n > best_n:
                best, best_n = child, n
        return None if best is None else (best, best_n)

    def _match_pages(self, node: RadixNode, tokens: Sequence[int], start: int, limit: int) -> int:
        ps, n = self.page_size, 0
        while n < len(node.pages) and start + n < limit:
            a = (start + n) * ps
            if node.key[n * ps : (n + 1) * ps] != list(tokens[a : a + ps]):
                break
            n += 1
        return n

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut `node` after its first n pages; returns the new upper part."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < n < len(node.pages)
        upper = RadixNode(node.key[: n * ps], node.pages[:n], parent, ref=node.ref,
                          last_access=node.last_access, first_hash=node.first_hash)
        parent.children[tuple(upper.key[:ps])] = upper
        node.key, node.pages, node.parent = node.key[n * ps :], node.pages[n:], upper
        node.first_hash = None  # it begins one split later now
        self._offer(node)  # re-keyed: a waiting prompt may want its first page no longer
        upper.children[tuple(node.key[:ps])] = node
        return upper

    # ---- insert ---------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[int, RadixNode]:
        """Cache `pages` (one per page_size tokens of `tokens`).

        Returns (pages already cached, last node). The caller owns its pages in that already-cached
        range and frees those that differ from the tree's (duplicates computed concurrently);
        the tree owns the rest from now on.
        """
        ps = self.page_size
        n_pages = min(len(pages), len(tokens) // ps)
        node, i = self.root, 0
        now = next(self._clock)
        while i < n_pages:
            child = node.children.get(tuple(tokens[i * ps : (i + 1) * ps]))
            if child is None:
                new = RadixNode(list(tokens[i * ps : n_pages * ps]), list(pages[i:n_pages]), node,
                                last_access=now)
                node.children[tuple(new.key[:ps])] = new
                self.evictable_pages += len(new.pages)
                self.total_pages += len(new.pages)
                self._offer(new)
                return i, new
            n = self._match_pages(child, tokens, i, n_pages)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            i += n
            node = child
        return i, node

    # ---- locking --------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node is not self.root and node is not None:
            if node.ref == 0:
                self.evictable_pages -= len(node.pages)
            node.ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root and node is not None:
            node.ref -= 1
            assert node.ref >= 0
            if node.ref == 0:
                self.evictable_pages += len(node.pages)
                self._offer(node)
            node = node.parent  # type: ignore[assignment]

    def unlocked_pages(self, node: RadixNode) -> int:
        """Pages on the path from `node` up that nothing holds: evictable now, not once locked."""
        n = 0
        while node is not self.root and node is not None:
            if node.ref == 0:
                n += len(node.pages)
            node = node.parent  # type: ignore[assignment]
        return n

    # ---- eviction -------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked leaves, those no waiting prompt needs
        first, each kind oldest first; returns pages freed."""
        ps, freed = self.page_size, 0
        if len(self._heap) > 4 * self.total_pages + 64:  # mostly stale (a node holds >= 1 page)
            self.rekey()
        while freed < num_pages and self._heap:
            wanted, last, _, node = heapq.heappop(self._heap)
            parent = node.parent
            if (parent is None or node.ref or node.children
                    or parent.children.get(tuple(node.key[:ps])) is not node):
                continue  # locked, no longer a leaf, or already evicted
            key = (self._wanted(node), node.last_access)
            if key != (wanted, last):
                heapq.heappush(self._heap, (*key, id(node), node))
                continue
            del parent.children[tuple(node.key[:ps])]
            self._free_pages(node.pages)
            freed += len(node.pages)
            self.evictable_pages -= len(node.pages)
            self.total_pages -= len(node.pages)
            self._offer(parent)
        return freed

    def _offer(self, node: RadixNode) -> None:
        """An unlocked leaf joins the eviction candidates (anything else is left out)."""
        if node is not self.root and node.ref == 0 and not node.children:
            heapq.heappush(self._heap, (self._wanted(node), node.last_access, id(node), node))

    def rekey(self) -> None:
        """Rank every eviction candidate afresh: after waiting prompts left without starting
        (a prompt that starts locks what it wanted, and its leaves are re-ranked as unlocked)."""
        self._heap = [(self._wanted(n), n.last_access, id(n), n) for n in self._leaves()
                      if n.ref == 0]
        heapq.heapify(self._heap)

    def _wanted(self, node: RadixNode) -> bool:
        """Whether a waiting prompt begins with the node's path through its first page."""
        if node.first_hash is None:
            parent = node.parent
            assert parent is not None
            node.first_hash = next(page_hashes(node.key[: self.page_size], self.page_size,
                                               self._end_hash(parent)))
        return self.demand.wants(node.first_hash)

    def _end_hash(self, node: RadixNode) -> int:
        """page_hashes of the path from the root through `node`'s last page (memoised)."""
        todo: list[RadixNode] = []
        h = node.end_hash
        while h is None:  # the root's is 0
            todo.append(node)
            node = node.parent  # type: ignore[assignment]
            h = node.end_hash
        for n in reversed(todo):
            *_, h = page_hashes(n.key, self.page_size, h)
            n.end_hash = h
        return h

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                out.append(n)
        return out

    def nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out


@dataclass(eq=False)
class PageCopy:
    """Into page `dst`, in every layer: slots lo .. hi - 1 of page src, for each (src, lo, hi)."""

    dst: int  # the starting request's own page
    ranges: list[tuple[int, int, int]]
    holder: RadixNode  # locked until the copy is done: the pages it reads stay where they are


class PageCopies:
    """Copies of shared partial pages, done by the next forward (AttentionBatch.page_copies):
    in each layer after the step's new K/V are written and before anything attends, so a page
    that is prefilled in that same step serves too. They run together, so a page that is itself
    being copied into gives its copied slots from where they come (`_sources`): whatever order
    the requests start in, each shares all that the cached pages hold."""

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self.pending: list[PageCopy] = []

    def share(self, node: RadixNode, tokens: Sequence[int], start: int, limit: int,
              alloc: Callable[[], int | None]) -> tuple[int, int] | None:
        """Past `node` (`start` whole cached pages of `tokens`), a cached page that begins with
        1 .. `limit` of the next tokens (match_partial): a page from `alloc` (None: no room)
        that the next forward copies them into, and how many; None if no page shares any."""
        hit = self.cache.match_partial(node, tokens, start, limit)
        if hit is None:
            return None
        holder, n = hit
        self.cache.lock(holder)  # no eviction, alloc's included, takes the source before the copy
        page = alloc()
        if page is None:
            self.cache.unlock(holder)
            return None
        self.pending.append(PageCopy(page, self._sources(holder.pages[0], n), holder))
        return page, n

    def _sources(self, page: int, n: int) -> list[tuple[int, int, int]]:
        """(src, lo, hi) ranges holding slots 0 .. n - 1 of `page` when the copies run: those
        still to be copied into it from their own sources, the rest from the page itself
        (the step writes them first)."""
        into = next((c.ranges for c in self.pending if c.dst == page), [])
        out = [(src, lo, min(hi, n)) for src, lo, hi in into if lo < n]
        copied = max((hi for _, _, hi in into), default=0)
        return out + [(page, copied, n)] if n > copied else out

    def batch(self) -> list[tuple[int, int, int, int]]:
        """(src, dst, lo, hi) of every pending copy, for the next forward."""
        return [(src, c.dst, lo, hi) for c in self.pending for src, lo, hi in c.ranges]

    def done(self) -> None:
        """The forward has run: release the sources."""
        for c in self.pending:
            self.cache.unlock(c.holder)
        self.pending.clear()

    def cancel(self, pages: Sequence[int]) -> None:
        """Drop the copies into `pages` (a request let go of them before a forward ran)."""
        mine = set(pages)
        for c in [c for c in self.pending if c.dst in mine]:
            self.cache.unlock(c.holder)
            self.pending.remove(c)
