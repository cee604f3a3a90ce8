"""Prefill chunks are padded in buckets of similar size, never a short prompt to a long one's."""

from __future__ import annotations

from runtime.attention.torch_backend import PAD_WASTE, prefill_buckets
from tests.runtime.test_engine import greedy, make_engine, prompts, run


def test_a_long_chunk_and_short_ones_are_padded_apart() -> None:
    q = [1500, 40, 60, 1400, 50]
    buckets = prefill_buckets(q, q)
    assert sorted(i for b in buckets for i in b) == list(range(5))
    assert [0, 3] in buckets and [1, 2, 4] in buckets


def test_every_bucket_keeps_its_padding_within_the_bound() -> None:
    q = [3, 700, 12, 256, 90, 91, 1024, 5, 300, 64]
    k = [x + c for x, c in zip(q, [0, 0, 512, 0, 40, 0, 0, 2000, 0, 64])]
    for b in prefill_buckets(q, k):
        padded = len(b) * max(q[i] for i in b) * max(k[i] for i in b)
        assert padded <= PAD_WASTE * sum(q[i] * k[i] for i in b) or len(b) == 1


def test_outputs_do_not_depend_on_what_shares_the_step() -> None:
    long_and_short = prompts(6, lo=3, hi=12, seed=9) + prompts(2, lo=90, hi=120, seed=10)
    reqs = greedy(long_and_short, max_tokens=6)
    together = run(make_engine(max_batch_tokens=512), reqs)  # one step: several buckets
    alone = {r.id: run(make_engine(max_batch_tokens=512), [r])[r.id] for r in reqs}
    assert {k: v.choices[0].token_ids for k, v in together.items()} == {
        k: v.choices[0].token_ids for k, v in alone.items()}
