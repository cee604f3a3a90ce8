"""Engine behaviour on a tiny random Llama: prefix reuse, no leaks, preemption, n > 1, errors."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from runtime.config import LoadedModel, ModelConfig
from runtime.engine import Engine, EngineConfig
from runtime.types import EngineRequest, RequestOutput, SamplingParams
from scheduler.types import PlanRequest, StepBudget
from tests.runtime.factories import WordTokenizer

VOCAB = 300
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


class AdmitAll:
    """The smallest AdmissionPolicy: everything, in order, at the first step."""

    def __init__(self, requests: Iterable[PlanRequest]) -> None:
        self.pending = list(requests)
        self.finished: dict[str, int] = {}

    def admit(self, budget: StepBudget) -> list[PlanRequest]:
        out, self.pending = self.pending, []
        return out

    def prefill_budget(self, budget: StepBudget) -> int | None:
        return None

    def on_finish(self, request_id: str, output_len: int) -> None:
        self.finished[request_id] = output_len

    def on_progress(self, request_id: str, generated: int) -> None:
        pass

    def has_pending(self) -> bool:
        return bool(self.pending)


def tiny_hf(**overrides: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()


def tiny_model(hf: torch.nn.Module | None = None) -> LoadedModel:
    hf = hf if hf is not None else tiny_hf()
    cfg = ModelConfig.from_hf({**hf.config.to_dict(), "eos_token_id": None})
    return LoadedModel("tiny", cfg, WordTokenizer(VOCAB), dict(hf.state_dict()))


def make_engine(model: LoadedModel | None = None, *, pages: int = 256, page_size: int = 4,
                max_batch_tokens: int = 64) -> Engine:
    m = model or tiny_model()
    per_page = 2 * m.config.num_layers * page_size * m.config.num_kv_heads * m.config.head_dim * 4
    return Engine(m, EngineConfig(max_batch_tokens=max_batch_tokens, kv_memory_bytes=pages * per_page,
                                  page_size=page_size, dtype="float32"))


def prompts(n: int, *, prefix: int = 0, lo: int = 3, hi: int = 20, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(1, VOCAB, (prefix,), generator=g).tolist()
    return [shared + torch.randint(1, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                   generator=g).tolist() for _ in range(n)]


def greedy(ps: list[list[int]], max_tokens: int = 8, **kw: object) -> list[EngineRequest]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)  # type: ignore[arg-type]
    return [EngineRequest(f"r{i}", p, params) for i, p in enumerate(ps)]


def run(engine: Engine, reqs: list[EngineRequest], **kw: object) -> dict[str, RequestOutput]:
    policy = kw.pop("policy", None) or AdmitAll(
        PlanRequest(r.id, r.prompt_token_ids, r.params.max_tokens) for r in reqs)
    return {o.id: o for o in engine.generate(reqs, policy=policy, **kw)}  # type: ignore[arg-type]


def tokens(outs: dict[str, RequestOutput]) -> dict[str, tuple[int, ...]]:
    return {k: o.choices[0].token_ids for k, o in outs.items()}


def alone(reqs: list[EngineRequest]) -> dict[str, tuple[int, ...]]:
    """Each request's tokens, run by itself in a fresh engine."""
    return {r.id: run(make_engine(), [r])[r.id].choices[0].token_ids for r in reqs}


def assert_no_leaks(engine: Engine) -> None:
    """Every page is free or held by the cache, and no cache node is still referenced."""
    assert engine.pool.num_free + engine.cache.total_pages == engine.pool.num_pages
    assert all(n.ref == 0 for n in engine.cache.nodes())
    assert engine.cache.evictable_pages == engine.cache.total_pages


def test_shared_system_prompt_is_prefilled_once() -> None:
    engine = make_engine()
    ps = prompts(6, prefix=40)
    first = run(engine, greedy(ps[:1]))
    assert first["r0"].cached_tokens == 0
    before = engine.stats.prefill_tokens
    rest = run(engine, greedy(ps[1:]))
    # the 40-token prefix is 10 whole pages: every later request computes only its own suffix
    assert all(o.cached_tokens == 40 for o in rest.values())
    assert engine.stats.prefill_tokens - before == sum(len(p) - 40 for p in ps[1:])
    assert engine.stats.cached_tokens == 5 * 40
    assert_no_leaks(engine)


def test_no_pages_leak_after_a_run_with_stops_and_errors() -> None:
    engine = make_engine()
    reqs = greedy(prompts(10, prefix=9)) + [
        EngineRequest("long", list(range(1, 600)), SamplingParams(max_tokens=4)),
        EngineRequest("zero", [1, 2, 3], SamplingParams(max_tokens=0)),
        EngineRequest("stopper", [5, 6, 7], SamplingParams(max_tokens=30, stop=("w",))),
    ]
    out = run(engine, reqs)
    assert len(out) == 13
    assert out["long"].error is not None and out["long"].error.code == "context_length_exceeded"
    assert out["zero"].error is not None and out["zero"].error.param == "max_tokens"
    assert out["stopper"].choices[0].text == "" and out["stopper"].choices[0].finish_reason == "stop"
    assert all(len(out[f"r{i}"].choices[0].token_ids) == 8 for i in range(10))
    assert_no_leaks(engine)


def test_preemption_by_recompute_keeps_greedy_outputs() -> None:
    ps = prompts(8, lo=10, hi=30)
    reqs = greedy(ps, max_tokens=24)
    roomy = make_engine()
    expected = {k: v.choices[0].token_ids for k, v in run(roomy, reqs).items()}
    tight = make_engine(pages=24)  # 96 tokens of KV for 8 requests of up to 53 tokens
    got = run(tight, reqs)
    assert tight.stats.preemptions > 0
    assert {k: v.choices[0].token_ids for k, v in got.items()} == expected
    assert_no_leaks(tight)


def test_n_choices_share_the_prompt_and_seeds_reproduce() -> None:
    engine = make_engine()
    p = prompts(1, lo=30, hi=31)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, n=3, ignore_eos=True)
    a = run(engine, [EngineRequest("a", p, params)])["a"]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len({c.token_ids for c in a.choices}) > 1  # different seeds per choice
    # the prompt's whole pages were computed once; forks recompute at most the partial page
    assert engine.stats.prefill_tokens <= len(p) + 2 * (len(p) % 4 or 4)
    b = run(make_engine(), [EngineRequest("a", p, params)])["a"]
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert a.completion_tokens == 36
    assert_no_leaks(engine)


def test_logprobs_come_back_per_token() -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True)
    out = run(engine, [EngineRequest("x", [1, 2, 3], params)])["x"].choices[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for lp, tok in zip(out.logprobs, out.token_ids):
        assert lp.token_id == tok and lp.top[0][0] == tok and lp.logprob <= 0
        assert len(lp.top) == 2 and lp.token == f"w{tok} "


def test_should_stop_finishes_running_requests_and_skips_the_rest() -> None:
    engine = make_engine(max_batch_tokens=16)
    reqs = greedy(prompts(6, lo=10, hi=12), max_tokens=4)
    from scheduler.policies import make_policy

    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    policy = make_policy("fcfs", (PlanRequest(r.id, r.prompt_token_ids, 4, 4) for r in reqs),
                         kv_capacity_tokens=engine.kv_capacity_tokens)
    out = run(engine, reqs, policy=policy, should_stop=stop)
    # requests that had started finish in full; the ones still queued never ran
    assert 0 < len(out) < len(reqs)
    assert all(len(o.choices[0].token_ids) == 4 for o in out.values())
    assert engine.stats.finished_requests == len(out)
    assert_no_leaks(engine)


def test_fcfs_policy_by_name_runs_every_request() -> None:
    engine = make_engine(pages=40)
    reqs = greedy(prompts(12, prefix=8), max_tokens=6)
    out = {o.id: o for o in engine.generate(iter(reqs), policy="fcfs")}
    assert sorted(out) == sorted(r.id for r in reqs)
    assert all(o.error is None and o.completion_tokens == 6 for o in out.values())
    assert engine.stats.finished_requests == 12
    assert_no_leaks(engine)


@pytest.mark.parametrize("bad", [[], [VOCAB + 5]])
def test_check_rejects_empty_and_out_of_vocabulary_prompts(bad: list[int]) -> None:
    engine = make_engine()
    assert engine.check(EngineRequest("x", bad, SamplingParams())) is not None
    assert engine.check(EngineRequest("x", [1], SamplingParams())) is None


def test_abandoning_the_generator_releases_every_page() -> None:
    engine = make_engine()
    reqs = greedy(prompts(6, lo=10, hi=20), max_tokens=30)
    reqs[0] = EngineRequest("r0", reqs[0].prompt_token_ids, SamplingParams(max_tokens=2))
    it = engine.generate(reqs, policy=AdmitAll(
        PlanRequest(r.id, r.prompt_token_ids, r.params.max_tokens) for r in reqs))
    next(it)  # one finished, the others still hold pages
    it.close()
    assert_no_leaks(engine)


class InGroups(AdmitAll):
    """Admits the requests in groups of `sizes`, one group an admission, the last group ahead of
    the queue; 16 prefill tokens a step."""

    def __init__(self, requests: Iterable[PlanRequest], sizes: list[int]) -> None:
        super().__init__(requests)
        self.sizes, self.ahead = list(sizes), 0

    def admit(self, budget: StepBudget) -> list[PlanRequest]:
        n = self.sizes.pop(0) if self.sizes else 0
        self.ahead = n if not self.sizes else 0
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def ahead_of_queue(self) -> int:
        return self.ahead

    def prefill_budget(self, budget: StepBudget) -> int | None:
        return 16


def test_a_request_the_policy_puts_ahead_prefills_before_the_waiting_prompts() -> None:
    # r0 (part-way through its prefill) goes on first; r2, admitted last, passes r1 (waiting)
    reqs = greedy([list(range(1, 61)), list(range(61, 121)), [5, 6, 7]], max_tokens=1)
    policy = InGroups((PlanRequest(r.id, r.prompt_token_ids, 1) for r in reqs), [1, 1, 1])
    assert [o.id for o in make_engine().generate(reqs, policy=policy)] == ["r0", "r2", "r1"]


def test_the_sequence_started_last_is_preempted_first_as_in_the_simulator() -> None:
    # Admitted a, b, c; started a, c, b (c was put ahead of b). When their decodes outgrow the
    # pool, b goes (started last), as the simulator's executor has it, not c (admitted last):
    # its recompute is its 40-token prompt and what it had generated.
    reqs = greedy([list(range(1, 17)), list(range(17, 57)), [5, 6, 7, 8]], max_tokens=40)
    policy = InGroups((PlanRequest(r.id, r.prompt_token_ids, 40) for r in reqs), [2, 1])
    tight = make_engine(pages=30)
    got = run(tight, reqs, policy=policy)
    assert tight.stats.preemptions == 1
    assert tight.stats.prefill_tokens - (16 + 40 + 4) >= 40
    assert {k: v.choices[0].token_ids for k, v in got.items()} == tokens(run(make_engine(), reqs))


def test_requests_admitted_together_compute_a_shared_prefix_once() -> None:
    # All six arrive in one step: the first caches the 40-token prefix as its chunk is scheduled,
    # the others share those pages in the same step instead of computing them again.
    engine = make_engine(max_batch_tokens=512)
    ps = prompts(6, prefix=40)
    out = run(engine, greedy(ps))
    assert [out[f"r{i}"].cached_tokens for i in range(6)] == [0] + [40] * 5
    assert engine.stats.prefill_tokens == sum(len(p) for p in ps) - 5 * 40
    assert_no_leaks(engine)


@pytest.mark.parametrize("together", [True, False], ids=["one-step", "later"])
def test_a_prefix_that_ends_inside_a_page_is_shared_to_the_token(together: bool) -> None:
    # 42 shared tokens: 10 pages of 4 and 2 tokens of the 11th, which the later requests copy
    # into a page of their own (from a page prefilled in the same step, or cached before)
    # instead of computing them again; each still gives what it gives alone.
    ps = [p[:42] + [i + 1] + p[42:] for i, p in enumerate(prompts(4, prefix=42, seed=5))]
    reqs = greedy(ps)
    engine = make_engine(max_batch_tokens=512)
    out = run(engine, reqs) if together else run(engine, reqs[:1]) | run(engine, reqs[1:])
    assert [out[f"r{i}"].cached_tokens for i in range(4)] == [0, 42, 42, 42]
    assert engine.stats.prefill_tokens == sum(len(p) for p in ps) - 3 * 42
    assert tokens(out) == alone(reqs)
    assert_no_leaks(engine)


def test_a_page_copied_into_in_the_same_step_is_shared_on() -> None:
    # Past 10 shared pages of 4: r1 shares 1 token of r0's 11th page, r2 3 tokens of r1's,
    # whose first slot is itself copied in that step.
    base = prompts(1, prefix=41, lo=0, hi=1, seed=7)[0]
    ps = [base + [7, 7, 7, 1, 2], base + [8, 9, 5, 3], base + [8, 9, 6, 4]]
    reqs = greedy(ps)
    engine = make_engine(max_batch_tokens=512)
    out = run(engine, reqs)
    assert [out[f"r{i}"].cached_tokens for i in range(3)] == [0, 41, 43]
    assert tokens(out) == alone(reqs)
    single = make_engine()
    run(single, reqs[2:])
    ours, its = (e.cache.match_prefix(ps[2])[0][10] for e in (engine, single))
    assert torch.equal(engine.pool.data[:, :, ours], single.pool.data[:, :, its])  # r2's 11th
    assert_no_leaks(engine)


@pytest.mark.parametrize("seed", [1, 3, 4])
def test_prefixes_ending_anywhere_in_a_page_under_preemption_give_what_a_roomy_pool_does(
        seed: int) -> None:
    # 24 prompts cut from one trunk at random lengths (shared runs end anywhere in a page) in a
    # pool that forces preemptions and evictions: copies dropped with their pages, sources
    # held until copied. Without the copies every one of these seeds gives other tokens.
    rng = random.Random(seed)
    trunk = [rng.randrange(1, VOCAB) for _ in range(40)]
    ps = [trunk[: rng.randrange(40)] + [rng.choice([5, 6, 7]) for _ in range(rng.randrange(1, 6))]
          + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(24)]
    reqs = greedy(ps, max_tokens=12)
    model = tiny_model()
    tight = make_engine(model, pages=32, max_batch_tokens=32)
    out = run(tight, reqs)
    roomy = run(make_engine(model, pages=1024, max_batch_tokens=512), reqs)
    assert tight.stats.preemptions > 0
    assert tokens(out) == tokens(roomy)
    assert_no_leaks(tight)


def test_a_prompt_seen_in_the_same_step_computes_only_its_last_token() -> None:
    # The copy into the second's last page is dropped when that page turns out to be the
    # first's: the page is freed at once and the third request's first page, written this step.
    same = prompts(1, prefix=12, lo=0, hi=1)[0]
    ps = [same, same, [same[0] % 299 + 1, *prompts(1, lo=11, hi=12, seed=6)[0]]]
    reqs = greedy(ps)
    engine = make_engine(max_batch_tokens=512)
    out = run(engine, reqs)
    assert out["r1"].cached_tokens == 11 and engine.stats.prefill_tokens == 12 + 1 + 12
    assert tokens(out) == alone(reqs)
    assert not engine.copies.pending  # type: ignore[union-attr]
    assert_no_leaks(engine)


def test_a_prefix_prefilled_over_several_steps_is_computed_once() -> None:
    # A 120-token shared prefix in 32-token steps: the second request starts only after the
    # first has cached the whole prefix, and computes its own suffix alone.
    engine = make_engine(max_batch_tokens=32)
    ps = prompts(2, prefix=120)
    out = run(engine, greedy(ps, max_tokens=3))
    assert out["r1"].cached_tokens == 120
    assert engine.stats.prefill_tokens == len(ps[0]) + len(ps[1]) - 120
    roomy = run(make_engine(max_batch_tokens=512), greedy(ps, max_tokens=3))
    assert {k: v.choices[0].token_ids for k, v in out.items()} == {
        k: v.choices[0].token_ids for k, v in roomy.items()}
    assert_no_leaks(engine)


def test_every_step_is_logged_with_its_shape() -> None:
    engine = make_engine(max_batch_tokens=512)
    ps = [[i + 1, *p] for i, p in enumerate(prompts(3, lo=9, hi=10))]  # nothing in common
    run(engine, greedy(ps, max_tokens=4))
    log = engine.step_log
    assert log[0].tokens == sum(len(p) for p in ps) and log[0].rows == 3 and log[0].decodes == 0
    assert log[0].pairs == sum(len(p) * (len(p) + 1) // 2 for p in ps)
    assert [r.decodes for r in log[1:]] == [3, 3, 3]
    assert log[1].kv_read == sum(len(p) + 1 for p in ps)
    assert all(r.seconds > 0 for r in log)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gather"])
def test_the_step_log_counts_a_prefix_shared_by_decodes_as_the_backend_reads_it(kernel: bool) -> None:
    engine = make_engine(max_batch_tokens=512)
    if kernel:
        assert engine.attn.decode_kernel is not None, "the CPU decode kernel did not build here"
    else:
        engine.attn.decode_kernel, engine.attn.prefill_kernel = None, False
    ps = prompts(4, prefix=40, lo=6, hi=7)  # 46-token prompts sharing 40 tokens (10 pages)
    run(engine, greedy(ps, max_tokens=3))
    first_decode = engine.step_log[1]
    assert first_decode.decodes == 4
    own = sum(len(p) + 1 - 40 for p in ps)  # past the shared pages: prompt tail + 1 token
    # the kernel reads the shared pages once per row; the gather path once for the group (cascade)
    assert first_decode.kv_read == (own + 4 * 40 if kernel else own + 40)
    # reads of pages another decode reads too: three rows' worth of the prefix, per row
    assert first_decode.kv_shared == (3 * 40 if kernel else 0)


def test_the_step_log_counts_the_rows_drawn_at_random() -> None:
    engine = make_engine(max_batch_tokens=512)
    ps = prompts(4)
    drawn = SamplingParams(max_tokens=3, temperature=0.9, seed=1, ignore_eos=True)
    reqs = greedy(ps[:2], max_tokens=3) + [EngineRequest(f"s{i}", p, drawn)
                                           for i, p in enumerate(ps[2:])]
    run(engine, reqs)
    assert [(r.rows, r.sampled) for r in engine.step_log] == [(4, 2)] * 3


def test_the_step_log_counts_nested_shared_prefixes_page_by_page() -> None:
    # four prompts on 40 tokens (10 pages of 4); two of them share 16 more (4 pages) and one a
    # 2-token tail: its partial page is its own
    base, more = prompts(1, prefix=40, lo=16, hi=17)[0][:40], prompts(1, lo=16, hi=17, seed=2)[0]
    ps = [base + more + [1 + i, 3 + i] for i in range(2)] + [base + [5 + i, 7 + i] for i in range(2)]
    engine = make_engine(max_batch_tokens=512)
    run(engine, greedy(ps, max_tokens=3))
    first_decode = engine.step_log[1]
    assert first_decode.decodes == 4
    assert first_decode.kv_shared == 3 * 40 + 16


def test_a_cached_prefix_that_would_start_a_prompt_is_not_also_counted_as_free() -> None:
    # 26 pages of 4 tokens. "x" leaves its 10-page prompt cached and unheld. "a" (15 pages,
    # growing 8 more) starts; one page is free. "b" is x's prompt plus 8 tokens: the 10 cached
    # pages would be held once it starts, so they cannot also be the room its other 3 pages
    # need. Started anyway, it is preempted as soon as a's decodes run out of pages.
    greedy_params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    x = list(range(101, 141))
    first = [EngineRequest("x", x, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))]
    reqs = [EngineRequest("a", list(range(1, 61)), greedy_params),
            EngineRequest("b", x + list(range(61, 69)),
                          SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))]
    expected = {k: v.choices[0].token_ids for k, v in run(make_engine(), reqs).items()}
    tight = make_engine(pages=26)
    run(tight, first)
    assert tight.cache.evictable_pages == 10
    got = run(tight, reqs)
    assert tight.stats.preemptions == 0
    assert {k: v.choices[0].token_ids for k, v in got.items()} == expected
    assert_no_leaks(tight)


def test_a_prompt_waits_until_it_fits_beside_the_decodes_instead_of_being_torn_down() -> None:
    # 24 pages of 4 tokens: "a" grows to 90 tokens (23 pages); "b" needs 10 pages for its prompt.
    # Started early, b's prefill would take the free pages that a's decodes need next, be
    # preempted as the newest, and start over; it waits for a to finish instead.
    reqs = [EngineRequest("a", list(range(1, 61)), SamplingParams(max_tokens=30, temperature=0,
                                                                  ignore_eos=True)),
            EngineRequest("b", list(range(61, 101)), SamplingParams(max_tokens=4, temperature=0,
                                                                    ignore_eos=True))]
    expected = {k: v.choices[0].token_ids for k, v in run(make_engine(), reqs).items()}
    tight = make_engine(pages=24)
    got = run(tight, reqs)
    assert tight.stats.preemptions == 0
    assert tight.stats.prefill_tokens == 100  # every prompt token computed once
    assert {k: v.choices[0].token_ids for k, v in got.items()} == expected
    assert_no_leaks(tight)


_FAULTS_PER_CYCLE = """
import resource, sys, torch
sys.path.insert(0, ".")

def faults() -> int:  # page faults of a 100 MB step temporary, allocated, written and freed
    torch.empty(100 << 20, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(100 << 20, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

first = min(faults() for _ in range(3))
from tests.runtime.test_engine import make_engine
make_engine()
print(first, min(faults() for _ in range(3)))
"""


def test_a_cpu_engine_reuses_a_steps_freed_memory_instead_of_faulting_it_in_again() -> None:
    """Each step's large temporaries (logits, activations) were mapped afresh and page-faulted
    in every step (runtime.engine.reuse_freed_memory). In a fresh process: the setting is
    process-wide."""
    out = subprocess.run([sys.executable, "-c", _FAULTS_PER_CYCLE], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[2]).stdout
    before, after = (int(x) for x in out.split())
    assert before > 10_000  # 100 MB in 4 KiB pages: 25,600, at every step
    assert after < 1_000  # once the heap holds the block


class OneAtATime(AdmitAll):
    """Admits the next request only once nothing runs: the requests run one after another."""

    def admit(self, budget: StepBudget) -> list[PlanRequest]:
        if budget.running or not self.pending:
            return []
        return [self.pending.pop(0)]


def test_a_prefix_a_waiting_request_needs_outlives_newer_unneeded_leaves() -> None:
    # r0 caches prefix P; r1 and r2 cache leaves nobody waits for; r3 needs room. Least recently
    # used alone would evict P (the oldest); r4 still waits for P, so the newer leaf goes.
    engine = make_engine(pages=36, max_batch_tokens=128)
    shared = prompts(2, prefix=40, lo=4, hi=5, seed=3)
    other = prompts(3, lo=40, hi=41, seed=4)
    reqs = greedy([shared[0], *other, shared[1]], max_tokens=4)
    out = run(engine, reqs, policy=OneAtATime(
        PlanRequest(r.id, r.prompt_token_ids, r.params.max_tokens) for r in reqs))
    assert engine.stats.preemptions == 0
    assert out["r4"].cached_tokens == 40
    assert_no_leaks(engine)


def test_steps_count_the_kv_they_write_on_pages_never_used() -> None:
    engine = make_engine(pages=256)
    reqs = greedy(prompts(6, prefix=9, seed=4), max_tokens=10)
    run(engine, reqs)
    first = [r.fresh_kv for r in engine.step_log]
    ps = engine.pool.page_size
    # every page the run took was new: the steps count them all (those it freed again too)
    held = engine.pool.num_pages - engine.pool.num_free
    assert sum(first) == ps * engine.pool.pages_ever_taken >= ps * held > 0 and first[0] > 0
    engine.cache.evict(engine.cache.total_pages)  # the same run again takes pages used before
    run(engine, reqs)
    assert sum(r.fresh_kv for r in engine.step_log) == 0


class ProgressLog(AdmitAll):
    """AdmitAll that keeps every progress report."""

    def __init__(self, requests: Iterable[PlanRequest]) -> None:
        super().__init__(requests)
        self.reports: dict[str, list[int]] = {}

    def on_progress(self, request_id: str, generated: int) -> None:
        self.reports.setdefault(request_id, []).append(generated)


def test_progress_is_reported_from_the_first_token() -> None:
    # A request reported only at 16 tokens looked to the policy as if it had not started
    # decoding (so did its KV growth and its end): the stagger's packing slipped 4-8 steps at each
    # repack, 404 steps where the simulator, reporting from the first token, took 334.
    reqs = greedy(prompts(3), max_tokens=40)
    policy = ProgressLog(PlanRequest(r.id, r.prompt_token_ids, r.params.max_tokens) for r in reqs)
    outs = run(make_engine(), reqs, policy=policy)
    assert all(o.completion_tokens == 40 for o in outs.values())
    assert policy.reports == {r.id: [1, 16, 32] for r in reqs}
