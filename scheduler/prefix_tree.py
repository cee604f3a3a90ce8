"""The radix tree over prompt token ids that the planner orders requests by.

Built from sorted prompts and the longest common prefixes of sorted neighbours (the suffix-array
trick), so it costs one sort plus one pass and holds at most 2n + 1 nodes: no node per token.
Nodes are numbered in preorder; every request is its own leaf (its edge may be empty when its
prompt ends where another continues or repeats it), so leaves in preorder are a DFS order and a
subtree covers a contiguous range of leaves. Per-node sums are then prefix-sum differences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class NodeStats:
    """Per-node subtree figures for one set of output lengths; arrays are indexed by node id."""

    requests: np.ndarray  # [nodes] leaves (requests) in the subtree
    prompt_tokens: np.ndarray  # [nodes] Σ prompt lengths of those requests
    output_tokens: np.ndarray  # [nodes] Σ (estimated) output lengths
    computed_tokens: np.ndarray  # [nodes] prompt tokens prefilled when the subtree runs alone, DFS
    shared_tokens: np.ndarray  # [nodes] prompt_tokens − computed_tokens (served from cache)
    comp: np.ndarray  # [nodes] seconds: computed + output tokens, rows, prefill attention
    mem: np.ndarray  # [nodes] seconds: Σ Mem(p, d)
    rho: np.ndarray  # [nodes] comp / mem (inf when no decode)


class PrefixTree:
    """Radix tree over token ids with compressed edges; see the module docstring for the layout."""

    def __init__(
        self,
        parent: np.ndarray,
        depth: np.ndarray,
        ref: np.ndarray,
        leaf_lo: np.ndarray,
        leaf_hi: np.ndarray,
        request: np.ndarray,
        leaf_requests: np.ndarray,
        prompt_lens: np.ndarray,
    ) -> None:
        self.parent = parent  # [nodes] parent node id, -1 for the root (node 0)
        self.depth = depth  # [nodes] tokens from the root to the end of the node's edge
        self.ref = ref  # [nodes] a request whose prompt spells the node's path
        self.leaf_lo = leaf_lo  # [nodes] first leaf position (DFS) in the subtree
        self.leaf_hi = leaf_hi  # [nodes] one past the last leaf position
        self.request = request  # [nodes] request index of a leaf, -1 for an internal node
        self.leaf_requests = leaf_requests  # [leaves] request index at each DFS leaf position
        self.prompt_lens = prompt_lens  # [requests]
        n_nodes = len(parent)
        self.edge_len = depth - np.where(parent >= 0, depth[np.maximum(parent, 0)], 0)
        self.subtree_end = np.searchsorted(leaf_lo, leaf_hi, side="left")  # preorder range end
        self.subtree_end = np.maximum(self.subtree_end, np.arange(n_nodes) + 1)
        self.leaf_node = np.empty(len(prompt_lens), dtype=np.int64)  # [requests] -> node id
        leaves = np.flatnonzero(request >= 0)
        self.leaf_node[request[leaves]] = leaves
        order = np.argsort(parent, kind="stable")  # children grouped by parent, preorder within
        self._child_ids = order[1:]  # drop the root (parent -1 sorts first)
        self._child_ptr = np.searchsorted(parent[self._child_ids], np.arange(n_nodes + 1))

    # ---------------------------------------------------------------- construction
    @classmethod
    def build(cls, prompts: Sequence[Sequence[int]]) -> PrefixTree:
        """Sort prompts (as big-endian uint32 bytes, so memcmp order = token order), then stack-build."""
        n = len(prompts)
        keys = [np.asarray(p, dtype=">u4").tobytes() for p in prompts]
        lens = np.fromiter((len(k) // 4 for k in keys), dtype=np.int64, count=n)
        order = sorted(range(n), key=keys.__getitem__)
        lcp = _neighbour_lcp(keys, order, lens)
        return cls._from_sorted(order, lcp, lens)

    @classmethod
    def _from_sorted(cls, order: list[int], lcp: list[int], lens: np.ndarray) -> PrefixTree:
        # Stack of open nodes; a node's key is 2·depth (internal) or 2·len + 1 (leaf), so a leaf
        # is always deeper than any internal node at its own length and is closed by the next LCP.
        par: list[int] = [-1]
        dep: list[int] = [0]
        key: list[int] = [0]
        ref: list[int] = [order[0] if order else 0]
        lo: list[int] = [0]
        hi: list[int] = [len(order)]
        req: list[int] = [-1]
        stack = [0]
        for i, r in enumerate(order):
            lim = 2 * lcp[i]
            last = -1
            while key[stack[-1]] > lim:
                node = stack.pop()
                hi[node] = i
                if key[stack[-1]] >= lim:
                    par[node] = stack[-1]
                else:
                    last = node
            if last >= 0:  # a new branch point at depth lcp[i], adopting the closed chain
                new = len(par)
                par.append(stack[-1])
                dep.append(lcp[i])
                key.append(lim)
                ref.append(r)
                lo.append(lo[last])
                hi.append(-1)
                req.append(-1)
                par[last] = new
                stack.append(new)
            leaf = len(par)
            par.append(-1)
            dep.append(int(lens[r]))
            key.append(2 * int(lens[r]) + 1)
            ref.append(r)
            lo.append(i)
            hi.append(i + 1)
            req.append(r)
            stack.append(leaf)
        while len(stack) > 1:
            node = stack.pop()
            if hi[node] < 0:
                hi[node] = len(order)
            par[node] = stack[-1]
        # Renumber in preorder: by first leaf, then larger ranges (ancestors) first, then shallower.
        a_par, a_dep, a_key = np.array(par), np.array(dep), np.array(key)
        a_lo, a_hi, a_ref, a_req = np.array(lo), np.array(hi), np.array(ref), np.array(req)
        pre = np.lexsort((a_key, -a_hi, a_lo))
        rank = np.empty_like(pre)
        rank[pre] = np.arange(len(pre))
        new_par = np.where(a_par[pre] >= 0, rank[np.maximum(a_par[pre], 0)], -1)
        return cls(
            parent=new_par,
            depth=a_dep[pre],
            ref=a_ref[pre],
            leaf_lo=a_lo[pre],
            leaf_hi=a_hi[pre],
            request=a_req[pre],
            leaf_requests=np.asarray(order, dtype=np.int64),
            prompt_lens=lens,
        )

    # ---------------------------------------------------------------- structure
    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def num_requests(self) -> int:
        return len(self.prompt_lens)

    def children(self, node: int) -> np.ndarray:
        return self._child_ids[self._child_ptr[node] : self._child_ptr[node + 1]]

    def dfs_order(self) -> np.ndarray:
        """Request indices in DFS (lexicographic) order: the order with the most prefix sharing."""
        return self.leaf_requests

    def edge_tokens(self, node: int, prompts: Sequence[Sequence[int]]) -> list[int]:
        start = int(self.depth[self.parent[node]]) if self.parent[node] >= 0 else 0
        return list(prompts[int(self.ref[node])][start : int(self.depth[node])])

    @property
    def unique_tokens(self) -> int:
        """Distinct prompt tokens: what DFS with an unbounded cache prefills."""
        return int(self.edge_len.sum())

    @property
    def total_prompt_tokens(self) -> int:
        return int(self.prompt_lens.sum())

    def max_sharing_ratio(self) -> float:
        """s_max: prompt tokens a DFS order with an unbounded cache serves from cache / all."""
        total = self.total_prompt_tokens
        return 1.0 - self.unique_tokens / total if total else 0.0

    # ---------------------------------------------------------------- statistics
    def leaf_prefix_sum(self, per_request: np.ndarray) -> np.ndarray:
        """Σ of a per-request quantity over every node's subtree, via one cumulative sum."""
        cum = np.concatenate(
            ([0.0], np.cumsum(np.asarray(per_request, np.float64)[self.leaf_requests]))
        )
        return cum[self.leaf_hi] - cum[self.leaf_lo]

    def subtree_max(self, per_request: np.ndarray) -> np.ndarray:
        """[nodes] max of a per-request quantity over each node's subtree (sparse table)."""
        vals = np.asarray(per_request, dtype=np.float64)[self.leaf_requests]
        lo, hi = self.leaf_lo, self.leaf_hi
        out = np.full(self.num_nodes, -np.inf)
        if len(vals) == 0:
            return out
        levels = [vals]
        while 2 ** len(levels) <= len(vals):
            prev, w = levels[-1], 2 ** (len(levels) - 1)
            levels.append(np.maximum(prev[:-w], prev[w:]))
        width = np.maximum(hi - lo, 1)
        k = np.floor(np.log2(width)).astype(np.int64)
        for j in np.unique(k):
            sel = np.flatnonzero((k == j) & (hi > lo))
            out[sel] = np.maximum(levels[j][lo[sel]], levels[j][hi[sel] - (1 << j)])
        return out

    def subtree_edge_tokens(self) -> np.ndarray:
        """[nodes] Σ edge lengths over each subtree, the node's own edge included."""
        cum = np.concatenate(([0], np.cumsum(self.edge_len)))
        return cum[self.subtree_end] - cum[np.arange(self.num_nodes)]

    def stats(self, output_lens: np.ndarray, cost: CostModel) -> NodeStats:
        """Annotate every node with its subtree's requests, tokens, Σcomp, Σmem, sharing and ρ."""
        p = self.prompt_lens.astype(np.float64)
        d = np.asarray(output_lens, dtype=np.float64)
        prompt = self.leaf_prefix_sum(p)
        output = self.leaf_prefix_sum(d)
        parent_depth = self.depth - self.edge_len
        computed = self.subtree_edge_tokens() + parent_depth  # the path to the node, once
        mem = self.leaf_prefix_sum(cost.mem(p, d))
        # Prefill attention: the subtree's Σ p²/2 pairs, scaled to the tokens it computes.
        pairs = self.leaf_prefix_sum(p * p / 2.0) * np.where(prompt > 0, computed / np.maximum(prompt, 1.0), 0.0)
        comp = ((computed + output) * cost.seconds_per_token + output * cost.seconds_per_row
                + pairs * cost.seconds_per_pair)
        with np.errstate(divide="ignore", invalid="ignore"):
            rho = np.where(mem > 0, comp / np.where(mem > 0, mem, 1.0), np.inf)
        return NodeStats(
            requests=self.leaf_hi - self.leaf_lo,
            prompt_tokens=prompt,
            output_tokens=output,
            computed_tokens=computed,
            shared_tokens=prompt - computed,
            comp=comp,
            mem=mem,
            rho=rho,
        )


def _neighbour_lcp(keys: list[bytes], order: list[int], lens: np.ndarray) -> list[int]:
    """LCP in tokens of each sorted prompt with its predecessor (0 for the first)."""
    out = [0] * len(order)
    prev = None
    for i, r in enumerate(order):
        cur = keys[r]
        if prev is not None:
            m = min(len(prev), len(cur)) // 4
            if m and prev[:4] == cur[:4]:
                if prev[: 4 * m] == cur[: 4 * m]:
                    out[i] = m
                else:
                    a = np.frombuffer(prev, dtype=">u4", count=m)
                    b = np.frombuffer(cur, dtype=">u4", count=m)
                    out[i] = int(np.argmax(a != b))
        prev = cur
    return out
