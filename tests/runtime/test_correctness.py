"""Greedy output token-identical to transformers `generate` on the same weights (float32).

Covers a tiny random Llama, Qwen2-style q/k/v bias, Llama-3.1 rope scaling and the bundled
SmolLM2 — single and batched, with and without prefix-cache hits, with chunked prefill.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from runtime.config import LoadedModel
from runtime.engine import Engine, EngineConfig
from runtime.types import EngineRequest, SamplingParams
from tests.runtime.test_engine import (
    TINY,
    assert_no_leaks,
    greedy,
    make_engine,
    prompts,
    run,
    tiny_hf,
    tiny_model,
)


def hf_greedy(hf: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own greedy decode of one unpadded prompt, never stopping at EOS
    (compared with our ignore_eos; suppressing EOS with min_new_tokens would change the argmax)."""
    hf.generation_config.eos_token_id = None
    hf.config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + max_tokens
    return out[0, len(prompt):].tolist()


def check_against_hf(hf: torch.nn.Module, model: LoadedModel, ps: list[list[int]], *,
                     max_tokens: int = 10, max_batch_tokens: int = 64, warm: int = 0) -> Engine:
    """Run `ps` batched through our engine (optionally after `warm` of them ran alone, so the rest
    hit the prefix cache) and compare every output with transformers."""
    engine = make_engine(model, max_batch_tokens=max_batch_tokens)
    reqs = greedy(ps, max_tokens=max_tokens)
    out = run(engine, reqs[:warm]) if warm else {}
    out |= run(engine, reqs[warm:])
    for i, p in enumerate(ps):
        assert list(out[f"r{i}"].choices[0].token_ids) == hf_greedy(hf, p, max_tokens), f"prompt {i}"
    assert_no_leaks(engine)
    return engine


def test_tiny_llama_single_prompt_matches_transformers() -> None:
    hf = tiny_hf()
    check_against_hf(hf, tiny_model(hf), prompts(1, lo=17, hi=18), max_tokens=16)


def test_tiny_llama_batch_with_chunked_prefill_matches_transformers() -> None:
    hf = tiny_hf()
    # an 8-token budget splits every prompt (15..40 tokens) over several steps
    engine = check_against_hf(hf, tiny_model(hf), prompts(6, lo=15, hi=40), max_batch_tokens=8)
    assert engine.stats.steps > 20


def test_tiny_llama_prefix_cache_hits_match_transformers() -> None:
    hf = tiny_hf()
    ps = prompts(6, prefix=26, lo=1, hi=12)
    engine = check_against_hf(hf, tiny_model(hf), ps, warm=1)
    # 6 whole pages of 4 tokens and 2 tokens of the 7th (copied into a page of its own) each
    assert engine.stats.cached_tokens == 5 * 26


def test_llama3_rope_scaling_matches_transformers() -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    hf = tiny_hf(rope_scaling=rope, max_position_embeddings=512)
    model = tiny_model(hf)
    assert model.config.rope_scaling is not None
    check_against_hf(hf, model, prompts(3, lo=30, hi=60), max_tokens=12)


def test_qwen2_bias_and_tied_embeddings_match_transformers() -> None:
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True,
                                      architectures=["Qwen2ForCausalLM"])).eval()
    with torch.no_grad():  # random init leaves biases at zero: make them matter
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model = tiny_model(hf)
    assert model.config.attention_bias
    check_against_hf(hf, model, prompts(3, prefix=9), warm=1)


@pytest.fixture(scope="module")
def smollm(default_model: LoadedModel, default_model_dir: Path) -> tuple[torch.nn.Module, LoadedModel]:
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return hf, default_model


def smollm_prompts(model: LoadedModel) -> list[list[int]]:
    tok = model.tokenizer
    system = {"role": "system", "content": "You are a concise assistant. Answer in one short "
              "sentence and never use lists. Be friendly, accurate and brief in every reply."}
    users = ["What is the capital of France?", "Name a primary colour.",
             "Why is the sky blue? Explain it briefly."]
    return [tok.apply_chat_template([system, {"role": "user", "content": u}]) for u in users]


def test_smollm2_batched_with_cache_hits_and_chunks_matches_transformers(
    smollm: tuple[torch.nn.Module, LoadedModel],
) -> None:
    hf, model = smollm
    ps = smollm_prompts(model)
    engine = Engine(model, EngineConfig(max_batch_tokens=32, kv_memory_bytes=64 << 20,
                                        page_size=16, dtype="float32"))
    reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            for i, p in enumerate(ps)]
    out = run(engine, reqs[:1])
    out |= run(engine, reqs[1:])
    assert all(out[f"r{i}"].cached_tokens >= 32 for i in (1, 2))  # the shared system prompt
    for i, p in enumerate(ps):
        ours = list(out[f"r{i}"].choices[0].token_ids)
        ref = hf_greedy(hf, p, 12)
        assert ours == ref, f"prompt {i}: {model.tokenizer.decode(ours)!r} vs {model.tokenizer.decode(ref)!r}"
    assert_no_leaks(engine)


def test_smollm2_stops_at_eos_like_transformers(smollm: tuple[torch.nn.Module, LoadedModel]) -> None:
    hf, model = smollm
    p = smollm_prompts(model)[0]
    engine = Engine(model, EngineConfig(kv_memory_bytes=32 << 20, dtype="float32"))
    out = run(engine, [EngineRequest("r", p, SamplingParams(max_tokens=24, temperature=0))])["r"]
    choice = out.choices[0]
    ref = hf_greedy(hf, p, 24)
    eos = set(model.tokenizer.eos_token_ids) | set(model.config.eos_token_ids)
    cut = next(i for i, t in enumerate(ref) if t in eos)  # "The capital of France is Paris."
    assert list(choice.token_ids) == ref[:cut] and choice.finish_reason == "stop"
    assert choice.text == model.tokenizer.decode(ref[:cut])


def test_greedy_outputs_do_not_depend_on_what_else_runs_in_the_step(
    default_model: LoadedModel,
) -> None:
    """In the engine's own dtype (bfloat16 here) a request's tokens and logprobs come out the
    same alone, batched with others, and under another step cap: one-row GEMMs take the many-row
    kernel's summation order, and a prompt's one-token chunk (a duplicate whose cached pages
    leave one token, at 273 ≡ 1 mod 16) is attended as a prefill, not by the decode kernel."""
    g = torch.Generator().manual_seed(7)
    lengths = [273, 40, 300, 7, 520]
    ps = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]
    ps.append(list(ps[0]))  # its pages cached by the time it starts: one token left to compute
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    reqs = [EngineRequest(f"r{i}", p, params) for i, p in enumerate(ps)]

    def outputs(cap: int, batches: list[list[EngineRequest]]) -> dict[str, list[tuple[int, float]]]:
        engine = Engine(default_model, EngineConfig(max_batch_tokens=cap, kv_memory_bytes=64 << 20))
        out: dict[str, list[tuple[int, float]]] = {}
        for batch in batches:
            for rid, o in run(engine, batch).items():
                out[rid] = [(t.token_id, t.logprob) for t in o.choices[0].logprobs or ()]
        assert_no_leaks(engine)
        return out

    alone = outputs(8192, [[r] for r in reqs])
    assert alone["r5"] == alone["r0"]  # the same prompt, its last token alone or in the chunk
    assert outputs(8192, [reqs]) == alone
    assert outputs(48, [reqs]) == alone  # chunked prompts, decodes mixed with prefill chunks
