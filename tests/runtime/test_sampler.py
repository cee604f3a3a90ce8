"""Sampler and stop rules: greedy, seeded sampling, top-k/top-p, penalties, logprobs, stops."""

from __future__ import annotations

import pytest
import torch

from runtime.attention import cpu_kernel
from runtime.sampler import (
    Sampler,
    SamplingState,
    StopChecker,
    _filter,
    _inverse_cdf,
    draw,
    greedy_tokens,
)
from runtime.types import SamplingParams
from tests.runtime.factories import WordTokenizer


def states(*params: SamplingParams) -> list[SamplingState]:
    return [SamplingState.create(p, 0, fallback_seed=123) for p in params]


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler().sample(logits, states(*[SamplingParams(temperature=0)] * 3))
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_bfloat16_logits_sample_as_their_float32_values_would() -> None:
    # The engine hands greedy rows over in the model dtype (no float32 copy of [R, V]): the
    # max takes the first of tied ids as argmax does, and draws, penalties and logprobs still
    # see float32 (a bfloat16 log-softmax would be off by ~1e-2).
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    logits[1, [17, 40, 250]] = 9.0  # a tie: the first id wins
    wide = logits.float()
    greedy = Sampler().sample(logits, states(*[SamplingParams(temperature=0)] * 4))
    assert [t.token_id for t in greedy] == wide.argmax(-1).tolist() and greedy[1].token_id == 17
    p = [SamplingParams(temperature=0, logprobs=True, top_logprobs=2),
         SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=0),
         SamplingParams(temperature=0, frequency_penalty=0.5)]
    got, ref = Sampler().sample(logits, states(*p)), Sampler().sample(wide, states(*p))
    assert [(t.token_id, t.logprob, t.top) for t in got] == [(t.token_id, t.logprob, t.top) for t in ref]
    assert torch.equal(logits.float(), wide)  # the penalty worked on a copy


def test_same_seed_same_tokens_and_mixed_batches_work() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)).repeat(2, 1)
    p = SamplingParams(temperature=1.0, seed=7)
    a = [Sampler().sample(logits[:1], s)[0].token_id for s in [states(p)] for _ in range(20)]
    s2 = states(p)
    b = [Sampler().sample(logits[1:], s2)[0].token_id for _ in range(20)]
    assert a == b and len(set(a)) > 1
    mixed = Sampler().sample(logits, states(SamplingParams(temperature=0), p))
    assert mixed[0].token_id == int(logits[0].argmax())


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler().sample(logits, states(SamplingParams(temperature=1.0, top_k=1, seed=1),
                                          SamplingParams(temperature=1.0, top_p=1e-6, seed=1)))
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_frequency_penalty_moves_greedy_off_a_repeated_token() -> None:
    logits = torch.zeros(1, 50)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.9
    st = states(SamplingParams(temperature=0, frequency_penalty=1.0))
    assert Sampler().sample(logits, st)[0].token_id == 5
    assert Sampler().sample(logits, st)[0].token_id == 6


def test_logprobs_report_chosen_and_top_tokens() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(2))
    out = Sampler().sample(logits, states(SamplingParams(temperature=0, logprobs=True, top_logprobs=3)))[0]
    lp = logits.log_softmax(-1)[0]
    assert abs(out.logprob - float(lp.max())) < 1e-5
    assert [i for i, _ in out.top] == lp.topk(3).indices.tolist()


def test_stop_string_is_cut_from_text_and_tokens() -> None:
    stop = StopChecker(SamplingParams(max_tokens=10, stop=("w3 w4",)), WordTokenizer(50), {0})
    assert not any(stop.append(t) for t in (1, 2, 3))
    assert stop.append(4)
    ids, text, reason = stop.result()
    assert (ids, text, reason) == ([1, 2], "w1 w2 ", "stop")


def test_eos_stops_unless_ignored_and_max_tokens_gives_length() -> None:
    stop = StopChecker(SamplingParams(max_tokens=5), WordTokenizer(50), {0})
    assert not stop.append(1) and stop.append(0)
    assert stop.result() == ([1], "w1 ", "stop")
    stop = StopChecker(SamplingParams(max_tokens=2, ignore_eos=True, stop_token_ids=(9,)),
                       WordTokenizer(50), {0})
    assert not stop.append(0) and stop.append(0)
    assert stop.result()[2] == "length"
    stop = StopChecker(SamplingParams(max_tokens=5, stop_token_ids=(9,)), WordTokenizer(50), {0})
    assert stop.append(9) and stop.result()[0] == []


def test_stop_strings_are_checked_without_decoding_the_whole_output_each_token() -> None:
    from runtime.sampler import StopChecker
    from tests.runtime.factories import WordTokenizer

    class Counting(WordTokenizer):
        decoded = 0

        def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
            Counting.decoded += len(ids)
            return super().decode(ids, skip_special_tokens)

    tok = Counting(1000)
    checker = StopChecker(SamplingParams(max_tokens=2000, stop=("w999 w7",)), tok, {0})
    n = 0
    while not checker.append(7 if n == 1500 else 999 if n == 1499 else 5 + n % 50):
        n += 1
    assert n == 1500 and checker.finish == "stop"
    assert Counting.decoded < 10 * n  # linear in the output; a full re-decode would be ~n²/2
    ids, text, _ = checker.result()
    assert text.endswith("w53 ") and "w999" not in text and ids[-1] == 53


def _awkward_logits(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 49,157 (not a multiple of 16) with ties, NaNs, infinities, a max in the tail."""
    x = torch.randn(9, 49157, generator=torch.Generator().manual_seed(8)).to(dtype)
    x[0, [5, 900]] = float("nan")  # the first NaN wins, as in torch
    x[1] = float("-inf")  # index 0
    x[2] = 1.0  # all tied: index 0
    x[3, [7000, 7001, 49000]] = 50.0  # the first of three tied maxima
    x[4, [3, 40000]] = float("inf")
    x[5, 49156] = 60.0  # the last element, in the partial 16-lane tail
    x[6, 49150] = float("nan")
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_tokens_are_torchs_first_max_on_ties_nans_and_infinities(dtype: torch.dtype) -> None:
    x = _awkward_logits(dtype)
    assert greedy_tokens(x) == x.max(-1).indices.tolist()
    strided = _awkward_logits(dtype)[:, :40001]  # rows 49,157 apart
    assert greedy_tokens(strided) == strided.max(-1).indices.tolist()
    assert greedy_tokens(x[:1]) == [x[0].max(-1).indices.item()]


def test_greedy_tokens_take_the_kernel_argmax_where_the_cpu_has_avx512() -> None:
    with open("/proc/cpuinfo") as f:
        if " avx512f" not in next((line for line in f if line.startswith("flags")), ""):
            pytest.skip("no AVX-512 here: greedy_tokens keeps torch's max")
    lib = cpu_kernel.load()
    assert lib is not None, "the CPU kernel did not build here"
    x = _awkward_logits(torch.bfloat16)
    assert cpu_kernel.argmax(lib, x) == x.max(-1).indices.tolist()


@pytest.mark.parametrize("peaked", [True, False], ids=["peaked", "flat"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.3, top_k=300),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.5),
], ids=["temperature", "top_p", "top_k", "top_k_past_the_window", "top_k_and_top_p"])
def test_draws_follow_the_filtered_softmax_whichever_path_a_row_takes(
        params: SamplingParams, peaked: bool) -> None:
    # 600 tokens, more than the TOP_WINDOW a row filters without a sort: a peaked row's nucleus
    # ends inside it, a flat row's does not; top_k 300 always sorts
    logits = torch.randn(600, generator=torch.Generator().manual_seed(4)) * (4.0 if peaked else 0.3)
    n = 4000
    want = _filter(logits[None] / params.temperature, torch.tensor([params.top_k]),
                   torch.tensor([params.top_p]))[0]  # the reference: a full sort
    want = want / want.sum()  # top-p drops mass without renormalizing: the draw does
    got = draw(logits.repeat(n, 1), [params] * n,
               [torch.Generator().manual_seed(i) for i in range(n)])
    freq = torch.bincount(torch.tensor(got), minlength=600).double() / n
    assert (freq[want == 0] == 0).all()  # nothing outside top-k / the nucleus
    assert (freq - want.double()).abs().max() < 0.03


def test_a_draw_at_the_top_of_the_cdf_takes_no_token_ruled_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # u × total can round up to the total in float32: searchsorted then points past the last
    # token that may be drawn (here, into two a grammar masked)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0))
    weights = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    assert _inverse_cdf(weights, [torch.Generator()] * 2).tolist() == [1, 1]
