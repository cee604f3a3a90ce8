"""Grammar-constrained decoding on a tiny random Llama: whatever the weights, every constrained
choice is JSON that validates against its schema; masks cover the padded vocabulary; logprobs are
of the masked distribution; grammars compile once per schema; a bad schema fails alone."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema
import pytest

from runtime.config import LoadedModel, ModelConfig
from runtime.engine import Engine
from runtime.grammar import Grammars
from runtime.response_format import parse_response_format
from runtime.types import EngineRequest, RequestOutput, ResponseFormat, SamplingParams
from tests.runtime.test_engine import VOCAB, make_engine, run, tiny_hf


class AsciiTokenizer:
    """One token per ASCII byte (id = byte + 3; 0-2 special, 2 = EOS): 131 ids, fewer than the
    tiny model's 300 logits, so ids 131-299 are LM-head padding a mask must exclude."""

    eos_token_ids = frozenset({2})
    vocab_size = 131

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 3 for b in text.encode("ascii", errors="replace")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < self.vocab_size).decode("ascii")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages))

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])


TOK = AsciiTokenizer()
SHAPES = {
    "nested": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", "axolotl"]},
        "owner": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "vaccinated": {"type": "boolean"}},
        "required": ["kind", "owner", "tags", "vaccinated"], "additionalProperties": False},
    "flat": {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
        "required": ["ok", "code"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    hf = tiny_hf()
    cfg = ModelConfig.from_hf({**hf.config.to_dict(), "eos_token_id": 2})
    assert cfg.vocab_size == VOCAB > TOK.vocab_size
    return make_engine(LoadedModel("tiny-ascii", cfg, TOK, dict(hf.state_dict())),
                       pages=512, max_batch_tokens=256)


def fmt(name: str) -> ResponseFormat:
    got = parse_response_format({"type": "json_schema", "json_schema": {
        "name": name, "schema": SHAPES[name], "strict": True}}, "")
    assert got is not None
    return got


def request(rid: str, name: str, prompt: str = "pets", **params: Any) -> EngineRequest:
    params.setdefault("max_tokens", 200)
    params.setdefault("temperature", 0)
    return EngineRequest(rid, TOK.encode(prompt),
                         SamplingParams(response_format=fmt(name), **params))


def assert_valid(out: RequestOutput, name: str) -> list[Any]:
    assert out.error is None, out.error
    values = []
    for c in out.choices:
        assert c.finish_reason == "stop", c.text
        assert all(3 <= t < TOK.vocab_size for t in c.token_ids)  # no special or padding ids
        value = json.loads(c.text)
        jsonschema.validate(value, SHAPES[name])
        values.append(value)
    return values


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_random_weights_still_produce_valid_json_greedy_and_sampled(engine: Engine,
                                                                    name: str) -> None:
    reqs = [request(f"g{i}", name, f"prompt {i}") for i in range(3)]
    reqs += [request(f"s{i}", name, f"prompt {i}", temperature=1.0, seed=i, n=3)
             for i in range(3)]
    out = run(engine, reqs)
    assert len(out) == 6
    sampled = [json.dumps(v) for i in range(3) for v in assert_valid(out[f"s{i}"], name)]
    for i in range(3):
        assert_valid(out[f"g{i}"], name)
    assert len(set(sampled)) > 1  # nine sampled choices are not all the same


def test_the_choice_ends_when_the_grammar_is_complete(engine: Engine) -> None:
    out = run(engine, [request("a", "flat"), request("b", "flat", ignore_eos=True)])
    for o in out.values():
        (c,) = o.choices
        assert c.finish_reason == "stop"
        assert len(c.token_ids) == len(c.text)  # one token per character, no EOS kept
        assert c.text.endswith("}")


def test_greedy_constrained_outputs_repeat_and_leave_free_rows_alone(engine: Engine) -> None:
    free = [EngineRequest(f"f{i}", TOK.encode(f"free {i}"),
                          SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            for i in range(3)]
    alone = run(engine, free)
    mixed = run(engine, free + [request(f"c{i}", "nested", f"c {i}") for i in range(3)])
    again = run(engine, [request(f"c{i}", "nested", f"c {i}") for i in range(3)])
    for i in range(3):
        assert mixed[f"f{i}"].choices[0].token_ids == alone[f"f{i}"].choices[0].token_ids
        assert mixed[f"c{i}"].choices[0].text == again[f"c{i}"].choices[0].text


def test_logprobs_are_those_of_the_masked_distribution(engine: Engine) -> None:
    out = run(engine, [request("lp", "nested", logprobs=True, top_logprobs=5)])["lp"]
    (c,) = out.choices
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    first = c.logprobs[0]
    assert first.token == "{" and first.logprob == 0.0  # the only token the grammar allows
    assert [t for _, t, _ in first.top] == ["{"]
    kind = c.logprobs[len('{"kind": "')]  # choosing among the enum values' first letters
    assert sorted(t for _, t, _ in kind.top) == ["a", "c", "d"]
    assert abs(sum(2.718281828 ** lp for _, _, lp in kind.top) - 1.0) < 1e-4
    for t in c.logprobs:
        assert all(tid < TOK.vocab_size and lp != float("-inf") for tid, _, lp in t.top)


def test_preempted_constrained_choices_resume_their_grammar() -> None:
    hf = tiny_hf()
    cfg = ModelConfig.from_hf({**hf.config.to_dict(), "eos_token_id": 2})
    model = LoadedModel("tiny-ascii", cfg, TOK, dict(hf.state_dict()))
    reqs = [request(f"r{i}", "nested", f"a longer prompt number {i}", max_tokens=120)
            for i in range(8)]
    roomy = run(make_engine(model, pages=512), reqs)
    tight_engine = make_engine(model, pages=48)  # 192 tokens of KV for 8 requests of ~140
    tight = run(tight_engine, reqs)
    assert tight_engine.stats.preemptions > 0
    for rid, o in tight.items():
        assert_valid(o, "nested")
        assert o.choices[0].text == roomy[rid].choices[0].text


def test_each_distinct_schema_compiles_once(engine: Engine, monkeypatch) -> None:
    compiles: list[str] = []
    compiler = engine.grammars._get_compiler()

    class Counting:
        def compile_grammar(self, grammar: Any) -> Any:
            compiles.append(grammar)
            return compiler.compile_grammar(grammar)

    engine.grammars._compiled.clear()
    monkeypatch.setattr(engine.grammars, "_compiler", Counting())
    reqs = [request(f"r{i}", ("flat", "nested")[i % 2], f"p{i}", n=2) for i in range(8)]
    out = run(engine, reqs)
    assert all(o.error is None for o in out.values())
    assert len(compiles) == len(SHAPES)  # 8 requests, 16 choices, 2 schemas
    assert sorted(engine.grammars._compiled) == sorted(fmt(n).key for n in SHAPES)


def test_a_schema_that_cannot_compile_fails_its_request_alone(engine: Engine) -> None:
    bad = ResponseFormat("json_schema", schema='{"type":"strin"}', name="oops")
    reqs = [request("good", "flat"),
            EngineRequest("bad", TOK.encode("x"), SamplingParams(response_format=bad))]
    err = engine.check(reqs[1])
    assert err is not None and err.param == "response_format" and "strin" in err.message
    assert "oops" in err.message and ".cc:" not in err.message  # no C++ source location
    out = run(engine, reqs)
    assert out["bad"].error == err
    assert_valid(out["good"], "flat")


def test_a_cut_at_max_tokens_is_reported_as_length(engine: Engine) -> None:
    (c,) = run(engine, [request("cut", "nested", max_tokens=5)])["cut"].choices
    assert c.finish_reason == "length" and len(c.token_ids) == 5


def test_grammar_time_is_logged_per_step(engine: Engine) -> None:
    run(engine, [request("t", "flat")])
    assert engine.step_log and all(r.grammar_seconds > 0 for r in engine.step_log)
    run(engine, [EngineRequest("f", [5, 6], SamplingParams(max_tokens=3, temperature=0))])
    assert all(r.grammar_seconds == 0 for r in engine.step_log)


def test_the_planner_sees_a_schema_prior_and_a_length_group(engine: Engine) -> None:
    plan = engine.plan_request(request("p", "nested", ignore_eos=True))
    assert plan.known_output_len is None  # a grammar ends it early, ignore_eos or not
    assert plan.length_group == fmt("nested").key
    assert plan.output_prior is not None and 20 < plan.output_prior < 200
    free = engine.plan_request(EngineRequest("f", [5], SamplingParams(max_tokens=9)))
    assert free.length_group is None and free.output_prior is None


def test_masks_cover_the_model_vocabulary_beyond_the_tokenizer(default_model_dir) -> None:
    import torch

    from runtime.tokenizer import HFTokenizer

    tok = HFTokenizer.from_folder(default_model_dir)
    grammars = Grammars(tok, tok.vocab_size + 64, tok.eos_token_ids)  # a padded LM head
    assert grammars.check(ResponseFormat("json_object")) is None
    matcher = grammars.matcher(ResponseFormat("json_object"))
    logits = torch.zeros(2, tok.vocab_size + 64)
    grammars.constrain(logits, [1], [matcher])
    assert bool((logits[0] == 0).all())  # the unconstrained row is untouched
    allowed = (logits[1] == 0).nonzero()[:, 0].tolist()
    assert allowed and max(allowed) < tok.vocab_size
    assert all(tok.decode([i]).startswith("{") for i in allowed)
    assert grammars.advance(matcher, tok.encode("{}", add_special_tokens=False)[0]) == \
        (True, False)  # "{}" is a complete object: nothing but EOS may follow
