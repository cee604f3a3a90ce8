"""`Engine.serve`: requests that arrive mid-run, priority levels, aborts, drain — on a tiny model."""

from __future__ import annotations

from collections.abc import Callable

from runtime.engine import Engine, FeedUpdate
from runtime.types import EngineRequest, RequestOutput
from tests.runtime.test_engine import assert_no_leaks, greedy, make_engine, prompts, run


class ScriptedFeed:
    """A feed that plays `script(step, outputs so far)` -> FeedUpdate at every poll."""

    def __init__(self, script: Callable[[int, dict[str, RequestOutput]], FeedUpdate]) -> None:
        self.script, self.polls = script, 0
        self.outputs: dict[str, RequestOutput] = {}

    def poll(self, idle: bool) -> FeedUpdate:
        self.polls += 1
        return self.script(self.polls, self.outputs)

    def run(self, engine: Engine, policy: str = "fcfs") -> dict[str, RequestOutput]:
        for out in engine.serve(self, policy=policy):
            assert out.id not in self.outputs, "each request finishes once"
            self.outputs[out.id] = out
        return self.outputs


def _tokens(outs: dict[str, RequestOutput]) -> dict[str, tuple[int, ...]]:
    return {k: v.choices[0].token_ids for k, v in outs.items()}


def test_requests_joining_mid_run_get_the_same_greedy_outputs_as_one_run() -> None:
    reqs = greedy(prompts(12, prefix=8, seed=3), max_tokens=10)
    expected = _tokens(run(make_engine(), reqs))

    def script(poll: int, outs: dict[str, RequestOutput]) -> FeedUpdate:
        if poll == 1:
            return FeedUpdate([(r, 0) for r in reqs[:4]])
        if poll == 4:  # the first ones are decoding: a second batch joins
            return FeedUpdate([(r, 0) for r in reqs[4:]])
        return FeedUpdate(closed=poll > 4)

    engine = make_engine()
    for policy in ("fcfs", "dfs", "blend"):
        got = ScriptedFeed(script).run(engine, policy)
        assert _tokens(got) == expected, policy
    assert_no_leaks(engine)


def test_a_higher_level_is_admitted_first() -> None:
    low = greedy(prompts(6, seed=4), max_tokens=30)
    high = [EngineRequest(f"h{i}", r.prompt_token_ids, r.params)
            for i, r in enumerate(greedy(prompts(2, seed=5), max_tokens=4))]
    order: list[str] = []

    def script(poll: int, outs: dict[str, RequestOutput]) -> FeedUpdate:
        order[:] = list(outs)
        if poll == 1:
            return FeedUpdate([(r, 0) for r in low] + [(r, 5) for r in high])
        return FeedUpdate(closed=True)

    engine = make_engine(pages=24, max_batch_tokens=16)  # room for a few requests at a time
    outs = ScriptedFeed(script).run(engine)
    assert set(outs) == {r.id for r in low + high}
    assert list(outs)[:2] == ["h0", "h1"]  # short and admitted first, they finish first
    assert_no_leaks(engine)


def test_aborted_requests_leave_at_once_and_free_their_pages() -> None:
    reqs = greedy(prompts(8, seed=6), max_tokens=100)
    keep = greedy(prompts(2, seed=7), max_tokens=6)
    keep = [EngineRequest(f"k{i}", r.prompt_token_ids, r.params) for i, r in enumerate(keep)]

    waiting_prefixes: list[int] = []

    def script(poll: int, outs: dict[str, RequestOutput]) -> FeedUpdate:
        waiting_prefixes.append(len(engine.cache.demand))
        if poll == 1:
            return FeedUpdate([(r, 0) for r in reqs + keep])
        if poll == 3:  # some running, some still waiting for KV: all of them go
            return FeedUpdate(aborts={r.id for r in reqs}, closed=True)
        return FeedUpdate(closed=poll > 3)

    engine = make_engine(pages=64)  # a few of the 8 fit at once: some run, some wait
    feed = ScriptedFeed(script)
    outs = feed.run(engine)
    assert set(outs) == {"k0", "k1"} and feed.polls < 20  # nobody ran 100 tokens
    assert waiting_prefixes[2] > 0 and waiting_prefixes[-1] == 0  # the aborted stopped waiting
    assert_no_leaks(engine)


def test_drain_finishes_what_started_and_admits_nothing_more() -> None:
    reqs = greedy(prompts(10, seed=8), max_tokens=12)

    def script(poll: int, outs: dict[str, RequestOutput]) -> FeedUpdate:
        if poll == 1:
            return FeedUpdate([(r, 0) for r in reqs])
        return FeedUpdate(drain=poll >= 3, closed=poll >= 3)

    engine = make_engine(pages=20, max_batch_tokens=16)  # only a few fit at a time
    outs = ScriptedFeed(script).run(engine)
    assert 0 < len(outs) < len(reqs)
    assert all(len(o.choices[0].token_ids) == 12 for o in outs.values())  # finished, not cut
    assert_no_leaks(engine)
