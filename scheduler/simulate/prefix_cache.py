"""The simulator's prefix cache: which prompt segments hold KV now, with the engine's eviction.

The trace's radix tree (scheduler.prefix_tree) already splits prompts at every point where two of
them diverge, so a cached prefix is always a set of whole tree nodes closed under "parent of".
Caching at node granularity is therefore exact: a request's hit is the depth of the deepest cached
node on its path. Nodes on a running request's path are pinned (reference-counted); unpinned
nodes with no cached child are evictable like the engine radix cache's leaves: those on no
waiting request's path first, each kind least recently used first (runtime/radix_cache.py).
"""

from __future__ import annotations

import heapq

from scheduler.prefix_tree import PrefixTree


class PrefixCache:
    """Node-granular KV bookkeeping over one trace's radix tree (token counts, not bytes)."""

    def __init__(self, tree: PrefixTree) -> None:
        self._parent: list[int] = tree.parent.tolist()
        self._edge: list[int] = tree.edge_len.tolist()
        self.depth: list[int] = tree.depth.tolist()  # tokens from the root to a node's end
        self._leaf: list[int] = tree.leaf_node.tolist()  # request index -> its leaf node
        n = tree.num_nodes
        self._cached = [False] * n
        self._cached[0] = True  # the root holds no tokens
        self._ref = [0] * n
        self._last = [0] * n  # step of the last pin or unpin (LRU clock)
        self._cached_children = [0] * n
        # requests still to start (the whole batch waits at first) whose path holds a node
        self._waiting: list[int] = (tree.leaf_hi - tree.leaf_lo).tolist()
        self._heap: list[tuple[bool, int, int]] = []  # (wanted, last use, node) eviction candidates
        self.cached_tokens = 0  # Σ edge over cached nodes
        self.pinned_tokens = 0  # Σ edge over cached nodes some running request pins

    def path(self, request: int) -> list[int]:
        """Nodes from just below the root down to the request's leaf."""
        out: list[int] = []
        node = self._leaf[request]
        while node > 0:
            out.append(node)
            node = self._parent[node]
        out.reverse()
        return out

    def acquire(self, path: list[int], now: int) -> int:
        """Pin a path (its request starts); returns how many of its leading prompt tokens are
        cached (the hit)."""
        hit = 0
        prefix = True
        for node in path:
            if self._cached[node]:
                if prefix:
                    hit = self.depth[node]
                if self._ref[node] == 0:
                    self.pinned_tokens += self._edge[node]
            else:
                prefix = False
            self._ref[node] += 1
            self._waiting[node] -= 1
            self._last[node] = now
        return hit

    def hit(self, path: list[int]) -> tuple[int, int]:
        """How many of a path's leading prompt tokens are cached (acquire's hit, nothing pinned),
        and how many of those no running request pins (evictable now, not once acquired)."""
        hit = unpinned = 0
        for node in path:
            if not self._cached[node]:
                break
            hit = self.depth[node]
            if self._ref[node] == 0:
                unpinned += self._edge[node]
        return hit, unpinned

    def fill(self, node: int) -> None:
        """A pinned node's tokens have been prefilled: they are cached from now on."""
        assert not self._cached[node] and self._ref[node] > 0
        self._cached[node] = True
        self._cached_children[self._parent[node]] += 1
        self.cached_tokens += self._edge[node]
        self.pinned_tokens += self._edge[node]

    def is_cached(self, node: int) -> bool:
        return self._cached[node]

    def release(self, path: list[int], now: int, *, again: bool = False) -> None:
        """Unpin a path (request finished, or preempted: it starts `again`); its cached nodes
        become evictable."""
        for node in path:
            self._ref[node] -= 1
            self._waiting[node] += int(again)
            self._last[node] = now
            if self._ref[node] == 0 and self._cached[node]:
                self.pinned_tokens -= self._edge[node]
                if self._cached_children[node] == 0:
                    heapq.heappush(self._heap, (self._wanted(node), now, node))

    def _wanted(self, node: int) -> bool:
        return self._waiting[node] > 0

    def evictable_tokens(self) -> int:
        return self.cached_tokens - self.pinned_tokens

    def evict(self, tokens: int) -> int:
        """Drop unpinned leaves, those no waiting request needs first, each kind least recently
        used first, until `tokens` are freed; returns tokens freed."""
        freed = 0
        heap = self._heap
        while freed < tokens and heap:
            wanted, last, node = heapq.heappop(heap)
            if (not self._cached[node] or self._ref[node] or self._cached_children[node]
                    or last != self._last[node] or wanted != self._wanted(node)):
                continue  # stale entry
            self._cached[node] = False
            self.cached_tokens -= self._edge[node]
            freed += self._edge[node]
            parent = self._parent[node]
            self._cached_children[parent] -= 1
            if parent > 0 and self._ref[parent] == 0 and self._cached_children[parent] == 0:
                heapq.heappush(heap, (self._wanted(parent), self._last[parent], parent))
        return freed
