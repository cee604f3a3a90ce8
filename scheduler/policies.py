"""Admission policies by name: the `fcfs`, `dfs` and `balance` baselines and the `blend` planner.

The baselines share one admission rule (`OrderedPolicy`): take requests in a fixed order while the
policy's own KV estimate fits, with no prefill pacing. Only the order differs, so a comparison
between them measures ordering. `blend` lives in `dual_scan/`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from scheduler.cost_model import CostModel
from scheduler.dual_scan import BlendPolicy
from scheduler.errors import UnknownNameError
from scheduler.prefix_tree import PrefixTree
from scheduler.types import AdmissionPolicy, PlanRequest, StepBudget

POLICY_NAMES = ("fcfs", "dfs", "balance", "blend")
DEFAULT_PRIOR_OUTPUT_LEN = 256  # output-length guess before any request has finished
PREFIX_CHUNK = 16  # tokens: the grain at which the baselines count a prompt prefix held once


class OutputLenGuess:
    """An online output-length guess for policies that do not sample: the mean of finished lengths
    of the request's length group (free text, or one structured-output format), else its prior."""

    def __init__(self, prior: int = DEFAULT_PRIOR_OUTPUT_LEN) -> None:
        self._seen: dict[str | None, tuple[int, int]] = {}  # length group -> (total, count)
        self._prior = prior

    def observe(self, output_len: int, group: str | None = None) -> None:
        total, count = self._seen.get(group, (0, 0))
        self._seen[group] = (total + output_len, count + 1)

    def guess(self, request: PlanRequest) -> int:
        if request.known_output_len is not None:
            return request.known_output_len
        total, count = self._seen.get(request.length_group, (0, 0))
        prior = self._prior if request.output_prior is None else request.output_prior
        mean = total / count if count else prior
        return max(1, min(request.max_tokens, round(mean)))


def kv_need_tokens(prompt_len: int, output_len: float) -> float:
    """Average KV a request holds over its life: its prompt plus half its output (DESIGN.md)."""
    return prompt_len + output_len / 2.0


class HeldPrefixes:
    """The prompts of running requests as chains of PREFIX_CHUNK-token chunks, each chunk a hash
    of everything before it: the prefix of a new prompt that the KV already holds (the engine's
    prefix cache computes and keeps a shared prefix once), and how many chunk tokens a finishing
    request frees. A chunk is held by the chain of everything before it, so the chunks a prompt
    finds held are a prefix of its chain."""

    def __init__(self) -> None:
        self._count: dict[int, int] = {}
        self._chains: dict[str, list[int]] = {}

    @staticmethod
    def chain(tokens: Sequence[int]) -> list[int]:
        keys, h = [], 0
        for end in range(PREFIX_CHUNK, len(tokens) + 1, PREFIX_CHUNK):
            h = hash((h, tuple(tokens[end - PREFIX_CHUNK:end])))
            keys.append(h)
        return keys

    def add(self, request_id: str, chain: list[int]) -> None:
        """Hold `chain` for a running request."""
        for k in chain:
            self._count[k] = self._count.get(k, 0) + 1
        self._chains[request_id] = chain

    def shared(self, chain: list[int]) -> int:
        """Tokens of `chain` that running requests hold."""
        n = 0
        while n < len(chain) and chain[n] in self._count:
            n += 1
        return n * PREFIX_CHUNK

    def remove(self, request_id: str) -> int:
        """Let a finished request's chunks go; returns the tokens of those no one holds now."""
        freed = 0
        for k in self._chains.pop(request_id, []):
            n = self._count[k] - 1
            if n:
                self._count[k] = n
            else:
                del self._count[k]
                freed += 1
        return freed * PREFIX_CHUNK


class OrderedPolicy:
    """Admits requests in the given order while their estimated KV fits; never paces prefill.

    The estimate is its own bookkeeping (Σ (p + d̂/2) over running requests ≤ capacity, a prompt
    prefix that several of them share counted once, as the engine's prefix cache holds it),
    checked against the executor's free KV for the prompt itself. When nothing runs it admits one
    request anyway, so a request larger than the estimate can never deadlock the batch.
    """

    def __init__(self, ordered: Iterable[PlanRequest], *, name: str) -> None:
        self.name = name
        self._it: Iterator[PlanRequest] = iter(ordered)
        self._next: PlanRequest | None = None
        self._exhausted = False
        self._reserved: dict[str, float] = {}
        self._groups: dict[str, str] = {}  # running request -> its length group, when it has one
        self._reserved_total = 0.0
        self._held = HeldPrefixes()
        self._next_chain: list[int] | None = None  # the next request's, once computed
        self._guess = OutputLenGuess()
        self._advance()

    def _advance(self) -> None:
        self._next_chain = None
        try:
            self._next = next(self._it)
        except StopIteration:
            self._next = None
            self._exhausted = True

    def admit(self, budget: StepBudget) -> list[PlanRequest]:
        out: list[PlanRequest] = []
        free_now = budget.free_kv_tokens - budget.waiting_prefill_tokens
        while self._next is not None:
            req = self._next
            if self._next_chain is None:  # once a request: a blocked one waits for steps
                self._next_chain = self._held.chain(req.prompt_token_ids)
            chain = self._next_chain
            shared = self._held.shared(chain)  # in the KV already, for running requests
            # Its own tokens (past its whole chunks) and its chunks that no one holds yet.
            own = kv_need_tokens(req.prompt_len - len(chain) * PREFIX_CHUNK, self._guess.guess(req))
            new = len(chain) * PREFIX_CHUNK - shared
            idle = budget.running == 0 and not out and not self._reserved
            fits = (
                self._reserved_total + own + new <= budget.kv_capacity_tokens
                and req.prompt_len - shared <= free_now
            )
            if not (fits or idle):
                break
            out.append(req)
            self._held.add(req.id, chain)
            free_now -= req.prompt_len - shared
            self._reserved[req.id] = own
            if req.length_group is not None:
                self._groups[req.id] = req.length_group
            self._reserved_total += own + new
            self._advance()
        return out

    def prefill_budget(self, budget: StepBudget) -> int | None:
        return None

    def on_finish(self, request_id: str, output_len: int) -> None:
        self._guess.observe(output_len, self._groups.pop(request_id, None))
        need = self._reserved.pop(request_id, None)
        if need is not None:
            self._reserved_total -= need + self._held.remove(request_id)
        if not self._reserved:
            self._reserved_total = 0.0  # drop float drift

    def on_progress(self, request_id: str, generated: int) -> None:
        return None

    def has_pending(self) -> bool:
        return self._next is not None

    def withdraw(self) -> list[PlanRequest]:
        out: list[PlanRequest] = []
        while self._next is not None:
            out.append(self._next)
            self._advance()
        return out


def make_policy(
    name: str,
    requests: Iterable[PlanRequest],
    *,
    kv_capacity_tokens: int,
    cost_model: CostModel | None = None,
    sample_rate: float = 0.01,
    seed: int = 0,
    step_tokens: int | None = None,
) -> AdmissionPolicy:
    """Build a policy; `fcfs` streams `requests`, the others read them all to plan.
    `step_tokens` is the executor's step cap (blend paces and fills its warm-up by it)."""
    if name == "fcfs":
        return OrderedPolicy(requests, name="fcfs")
    if name not in POLICY_NAMES:
        raise UnknownNameError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    reqs = list(requests)
    if name == "balance":
        order = np.random.default_rng(seed).permutation(len(reqs))
        return OrderedPolicy((reqs[i] for i in order), name="balance")
    tree = PrefixTree.build([r.prompt_token_ids for r in reqs])
    if name == "dfs":
        return OrderedPolicy((reqs[i] for i in tree.dfs_order()), name="dfs")
    return BlendPolicy(
        reqs,
        tree=tree,
        cost_model=cost_model or CostModel.default(),
        kv_capacity_tokens=kv_capacity_tokens,
        sample_rate=sample_rate,
        seed=seed,
        **({} if step_tokens is None else {"step_tokens": step_tokens}),
    )
