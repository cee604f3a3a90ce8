"""KV reads of a prompt prefix that several of a step's decodes share.

CascadeReads: what cascade attention saves, where decodes sharing a prefix read it once a step.
SharedReads: the reads a decode makes of pages another decode of the step reads too, where
each decode reads its own context (the CPU kernel): later rows find those pages in the CPU's
caches, and a measured profile prices them apart (StepCoefficients.s_per_shared_kv_token).

CascadeReads. The CPU runtime's gather path (runtime/attention/torch_backend.py) groups a
step's decodes by their first KV page and attends the pages the whole group shares once,
stacking the group's queries; each decode then reads only its own pages. A device profile that
says so (`HardwareProfile.cascade`) makes the simulator count reads the same way. The runtime's groups
are the decodes that start on the same page, so here they are the decodes through the same
node at the first page's end (the first node of a path at least a page deep; prompts that
share a system prompt after a common chat-template header of a few tokens are not one group).
A group's shared length is the depth of the deepest prefix-tree node every decoding member
passes through, in whole pages, and counts only from `min_pages` pages on, as the runtime does.
"""

from __future__ import annotations

from scheduler.dual_scan.memory import PAGE_TOKENS
from scheduler.prefix_tree import PrefixTree

MIN_SHARED_PAGES = 2  # TorchAttention.min_shared_pages


class CascadeReads:
    """Decoding requests by prefix-tree path, and the KV reads their groups share."""

    def __init__(self, tree: PrefixTree, page_size: int = PAGE_TOKENS,
                 min_pages: int = MIN_SHARED_PAGES) -> None:
        self._depth: list[int] = tree.depth.tolist()
        self._children: list[list[int]] = [tree.children(v).tolist()
                                           for v in range(tree.num_nodes)]
        self._ref = [0] * tree.num_nodes  # decoding requests through each node
        self._groups: dict[int, int] = {}  # node at the first page's end -> decoding members
        self._ps, self._min = page_size, min_pages
        self._saved = 0
        self._dirty = False

    def add(self, path: list[int]) -> None:
        self._update(path, 1)

    def remove(self, path: list[int]) -> None:
        self._update(path, -1)

    def _update(self, path: list[int], sign: int) -> None:
        if not path:
            return
        for node in path:
            self._ref[node] += sign
        top = next((v for v in path if self._depth[v] >= self._ps), None)
        if top is None:  # shorter than a page: nothing it could share
            return
        left = self._groups.get(top, 0) + sign
        if left:
            self._groups[top] = left
        else:
            self._groups.pop(top, None)
        self._dirty = True

    def shared_tokens(self) -> int:
        """KV tokens this step's decodes do not read because a group member reads them."""
        if self._dirty:
            self._saved = sum(self._group_saving(top, n) for top, n in self._groups.items() if n > 1)
            self._dirty = False
        return self._saved

    def _group_saving(self, top: int, members: int) -> int:
        node = top
        while True:  # down the path all members share
            nxt = next((c for c in self._children[node] if self._ref[c] == members), None)
            if nxt is None:
                break
            node = nxt
        pages = self._depth[node] // self._ps
        return pages * self._ps * (members - 1) if pages >= self._min else 0


class SharedReads:
    """Decoding requests by prefix-tree path, and the KV tokens their decodes read of pages
    another decode reads too: every whole page of the prefix-tree node it ends in is read once
    by each request through that node, one of them first (the runtime's decodes share the
    radix cache's pages of their common prefix, at any depth)."""

    def __init__(self, tree: PrefixTree, page_size: int = PAGE_TOKENS) -> None:
        depth = tree.depth
        parent_depth = depth - tree.edge_len
        # tokens of the whole pages that end inside each node's edge
        self._tokens: list[int] = ((depth // page_size - parent_depth // page_size)
                                   * page_size).tolist()
        self._ref = [0] * tree.num_nodes
        self._shared = 0

    def add(self, path: list[int]) -> None:
        for node in path:
            if self._ref[node]:
                self._shared += self._tokens[node]
            self._ref[node] += 1

    def remove(self, path: list[int]) -> None:
        for node in path:
            self._ref[node] -= 1
            if self._ref[node]:
                self._shared -= self._tokens[node]

    def shared_tokens(self) -> int:
        """KV tokens this step's decodes read that another decode reads too."""
        return self._shared
