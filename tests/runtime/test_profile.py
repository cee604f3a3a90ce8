"""The device profile: the step-time fit, a real measurement on a tiny model, and its cache."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import runtime.profile as profile_module
from runtime.host_load import LoadMeter
from runtime.profile import (
    CALIBRATION_BUDGET_S,
    CALIBRATION_SIZES,
    DRIFT_MAX,
    DRIFT_TOLERANCE,
    FEATURES,
    FRESH_TRIES,
    LARGE_BUDGET_S,
    LARGE_SIZES,
    Sample,
    cached_profile_path,
    calibration_requests,
    calibration_seconds,
    calibration_size,
    check_seconds,
    cost_model_from_profile,
    covers,
    drift,
    fit,
    fresh_kv_seconds,
    large_size,
    large_step_shapes,
    linear_kind,
    load_or_measure,
    measure,
    predict,
    rescaled,
    shared_step_shapes,
    step_shapes,
    time_step,
    write_profile,
)
from scheduler.cost_model import HardwareProfile
from tests.runtime.test_engine import make_engine, tiny_model

TRUE = {"step_fixed_s": 0.05, "s_per_token": 2e-3, "s_per_row": 1e-3, "s_per_pair": 5e-7,
        "s_per_kv_token": 1e-5, "s_per_shared_kv_token": 4e-6}


def _samples(noise: dict[int, float] | None = None) -> list[Sample]:
    out = []
    shapes = [(q, k, 0) for q, k in step_shapes(10**6)] + shared_step_shapes(10**6)
    for i, (q, k, shared) in enumerate(shapes):
        s = Sample.of(q, k, 0.0, shared)
        t = predict(TRUE, s) * (noise or {}).get(i, 1.0)
        out.append(Sample(s.tokens, s.rows, s.pairs, s.kv_read, t, s.kv_shared))
    return out


def test_the_fit_recovers_an_exact_step_model() -> None:
    coef, err = fit(_samples())
    assert err < 1e-9
    for name in FEATURES:
        assert coef[name] == pytest.approx(TRUE[name], rel=1e-6)


def test_one_timing_disturbed_by_other_load_does_not_bend_the_fit() -> None:
    coef, _ = fit(_samples({3: 3.0}))
    for name in ("step_fixed_s", "s_per_token", "s_per_kv_token"):
        assert coef[name] == pytest.approx(TRUE[name], rel=1e-6)


def test_timings_too_noisy_to_show_the_kv_reads_still_fit_a_usable_model() -> None:
    samples = [Sample(s.tokens, s.rows, s.pairs, s.kv_read, 0.01 + 1e-5 * s.tokens - 1e-7 * s.kv_read)
               for s in _samples()]  # more KV read, faster: noise, not a device
    coef, _ = fit(samples)
    assert coef["s_per_kv_token"] > 0 and coef["s_per_token"] > 0


def test_step_shapes_count_decode_reads_and_prefill_pairs() -> None:
    s = Sample.of([1, 1, 4], [10, 20, 6], 0.0)  # two decodes, a 4-token chunk over 2 cached
    assert (s.tokens, s.rows, s.kv_read, s.pairs, s.kv_shared) == (6, 3, 30, 4 * 2 + 10, 0)
    # three decodes on the same first 32 tokens: two of them read pages the first reads too
    s = Sample.of([1, 1, 1], [40, 50, 60], 0.0, shared=32)
    assert (s.kv_read, s.kv_shared) == (150, 64)


def test_shared_step_shapes_fit_the_pool_they_share() -> None:
    for q, k, shared in shared_step_shapes(10**6):
        assert set(q) == {1} and min(k) > shared > 0
    small = shared_step_shapes(40_000)  # the pages of the shared prefix counted once
    assert small and all(sum(k) - n * (len(k) - 1) <= 20_000 for _, k, n in small)


# SmolLM2-135M as measured: bf16 on an AVX512-BF16 core, and fp32 on a slow AVX2 VM.
FAST = {"step_fixed_s": 0.015, "s_per_token": 4.3e-4, "s_per_row": 0.0, "s_per_pair": 2e-7,
        "s_per_kv_token": 3e-6, "s_per_shared_kv_token": 1.5e-6}
SLOW = {"step_fixed_s": 0.15, "s_per_token": 2.7e-3, "s_per_row": 0.0, "s_per_pair": 2.4e-6,
        "s_per_kv_token": 2.8e-5, "s_per_shared_kv_token": 1.4e-5}


def test_a_slow_device_runs_a_smaller_calibration_within_the_budget() -> None:
    full = CALIBRATION_SIZES[0]
    assert calibration_size(FAST, 49152, 8192, 2048) == full
    n, longest = calibration_size(SLOW, 49152, 8192, 2048)
    assert (n, longest) != full
    reqs = calibration_requests(49152, 8192, n, longest)
    assert calibration_seconds(SLOW, reqs, 2048) <= CALIBRATION_BUDGET_S
    # the smaller run still holds the longest prompt, which `covers` compares
    assert max(len(r.prompt_token_ids) for r in reqs) == max(
        len(r.prompt_token_ids) for r in calibration_requests(49152, 8192, *full))
    assert max(r.params.max_tokens for r in reqs) == longest


def test_a_slower_device_times_smaller_large_shapes_within_their_budget() -> None:
    assert large_size(FAST, 10**6) == LARGE_SIZES[0]
    middling = {k: 3 * v for k, v in FAST.items()}
    size = large_size(middling, 10**6)
    assert 0 < size < LARGE_SIZES[0]
    shapes = large_step_shapes(10**6, size)
    assert len(shapes) == len(large_step_shapes(10**6))
    assert sum(2 * predict(middling, Sample.of(q, k, 0.0)) for q, k in shapes) <= LARGE_BUDGET_S
    # too slow for the smallest: none, and a profile without them still covers its engine
    assert large_size(SLOW, 10**6) == 0.0 and large_step_shapes(10**6, 0.0) == []


def test_the_large_shapes_hold_hundreds_of_decodes_and_a_prompt_as_long_as_many_short_ones(
        ) -> None:
    samples = [Sample.of(q, k, 0.0) for q, k in large_step_shapes(10**6)]
    assert max(s.rows for s in samples if s.pairs == 0) >= 512
    one = next(s for s in samples if s.rows == 1)
    many = next(s for s in samples if s.rows > 1 and s.kv_read == 0)
    assert one.tokens == many.tokens and one.pairs > 20 * many.pairs


def test_a_profile_measured_without_the_large_shapes_is_measured_again(tmp_path: Path) -> None:
    engine = make_engine(pages=4096, max_batch_tokens=512)
    profile, _, _ = load_or_measure(engine, tmp_path)
    cap = engine.kv_capacity_tokens
    large = large_step_shapes(cap, profile["fit"]["large_shapes_size"])
    shared = shared_step_shapes(cap)
    assert large and shared
    assert profile["fit"]["shapes"] == len(step_shapes(cap)) + len(shared) + len(large)
    assert covers(profile, engine)
    older = {**profile, "fit": {**profile["fit"], "shapes": len(step_shapes(cap))}}
    assert not covers(older, engine)


def test_a_measured_profile_loads_into_the_cost_model(tmp_path: Path) -> None:
    engine = make_engine(pages=4096, max_batch_tokens=512)
    profile = measure(engine, reps=1)
    assert profile["overlap"] == 0.0 and profile["device"] == "cpu"
    assert profile["step_model"]["s_per_token"] > 0 and profile["step_model"]["s_per_kv_token"] > 0
    assert profile["step_model"]["s_per_fresh_kv_token"] >= 0.0
    assert profile["step_model"]["s_per_sampled_row"] >= 0.0
    assert profile["fit"]["calibration_steps"] > 5
    if Path("/proc/stat").exists():  # what others took of the CPUs while it was measured
        assert 0.0 <= profile["fit"]["other_load"] <= 1.0 and 0.0 <= profile["fit"]["steal"] <= 1.0
    path = write_profile(tmp_path / "p.json", profile)
    hw = HardwareProfile.from_json(path)
    assert hw.measured is not None and hw.overlap == 0.0 and hw.batch_multiple == 1
    cost = cost_model_from_profile(profile)
    assert cost.seconds_per_fresh_kv_token == profile["step_model"]["s_per_fresh_kv_token"]
    assert cost.seconds_per_sampled_row == profile["step_model"]["s_per_sampled_row"]
    assert cost.shape.layers == engine.model.config.num_layers
    assert cost.step_fixed_s == pytest.approx(profile["step_model"]["step_fixed_s"])
    assert cost.kv_capacity_tokens == engine.kv_capacity_tokens


def test_the_profile_is_measured_once_and_cached_by_model_device_dtype_threads(
        tmp_path: Path) -> None:
    engine = make_engine(pages=4096, max_batch_tokens=512)
    first, path, fresh = load_or_measure(engine, tmp_path)
    assert fresh and path == cached_profile_path(tmp_path, engine) and path.is_file()
    assert path.name.startswith("tiny-cpu-float32-t")
    again, path2, fresh2 = load_or_measure(engine, tmp_path)
    assert not fresh2 and path2 == path and same_measurement(again, first)


def same_measurement(a: dict, b: dict) -> bool:
    """The same measurement, loaded again: its times may be rescaled by the drift check."""
    return a["measured_at"] == b["measured_at"] and a["fit"]["shapes"] == b["fit"]["shapes"]


def test_a_cached_profile_on_a_host_slower_since_is_rescaled_not_measured_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(pages=4096, max_batch_tokens=512)
    first, path, _ = load_or_measure(engine, tmp_path)
    then = first["fit"]["check_seconds"]
    assert then and then > 0  # timed on the real engine as the measurement began
    # The host now runs the check 30% slower (a timing stands in for it: a real one varies by
    # ±10% from one process to the next on the project's VMs).
    monkeypatch.setattr(profile_module, "check_seconds", lambda engine: then * 1.3)
    assert load_or_measure(engine, tmp_path)[0] == first  # by default: a warning only
    again, _, fresh = load_or_measure(engine, tmp_path, rescale=True)
    assert not fresh and again["measured_at"] == first["measured_at"]
    assert again["drift"]["ratio"] == pytest.approx(1.3)
    for name, value in first["step_model"].items():
        assert again["step_model"][name] == pytest.approx(value * 1.3)
    assert json.loads(path.read_text())["drift"]["ratio"] == pytest.approx(1.3)
    # Checked against the rescaled profile, the host has not moved since: nothing changes.
    assert load_or_measure(engine, tmp_path, rescale=True)[0] == again


@pytest.mark.parametrize("ratio", [1.0 + DRIFT_TOLERANCE / 2, 1.0 - DRIFT_TOLERANCE / 2,
                                   DRIFT_MAX * 1.2, 1.0 / (DRIFT_MAX * 1.2)])
def test_a_check_within_the_tolerance_or_past_the_burst_limit_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ratio: float) -> None:
    engine = make_engine(pages=4096, max_batch_tokens=512)
    first, _, _ = load_or_measure(engine, tmp_path)
    then = first["fit"]["check_seconds"]
    monkeypatch.setattr(profile_module, "check_seconds", lambda engine: then * ratio)
    assert load_or_measure(engine, tmp_path, rescale=True)[0] == first


@pytest.mark.parametrize(("first", "second", "rescale"),
                         [(1.3, 1.2, 1.2), (1.3, 1.02, None), (1.3, 0.7, None), (0.7, 0.8, 0.8)])
def test_a_check_past_the_tolerance_rescales_only_when_a_second_one_agrees(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: float, second: float,
        rescale: float | None) -> None:
    """A burst of other load shorter than two checks leaves the profile as it is."""
    engine = make_engine(pages=4096, max_batch_tokens=512)
    measured, _, _ = load_or_measure(engine, tmp_path)
    then = measured["fit"]["check_seconds"]
    readings = iter([first, second])
    monkeypatch.setattr(profile_module, "check_seconds", lambda engine: then * next(readings))
    again, _, _ = load_or_measure(engine, tmp_path, rescale=True)
    if rescale is None:
        assert again == measured
    else:
        assert again["drift"]["ratio"] == pytest.approx(rescale)


def test_rescaling_scales_every_time_and_keeps_the_total_drift() -> None:
    profile = {"step_model": {"step_fixed_s": 0.01, "s_per_token": 1e-3}, "flops": 1e12,
               "bandwidth_bytes_per_s": 1e10, "fit": {"check_seconds": 0.2}}
    once = rescaled(profile, 1.25)
    assert once["step_model"] == pytest.approx({"step_fixed_s": 0.0125, "s_per_token": 1.25e-3})
    assert once["flops"] == pytest.approx(0.8e12) and once["fit"]["check_seconds"] == 0.25
    twice = rescaled(once, 0.8)
    assert twice["drift"]["ratio"] == pytest.approx(1.0)
    assert twice["step_model"] == pytest.approx(profile["step_model"])


def test_a_drift_check_beside_a_busy_process_changes_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed while another process takes a core, the check would say the host slowed down."""
    engine = make_engine(pages=4096, max_batch_tokens=512)

    def check(engine: object) -> float:
        time.sleep(0.5)  # while the busy process runs
        return 1.3

    monkeypatch.setattr(profile_module, "check_seconds", check)
    profile = {"fit": {"check_seconds": 1.0}, "step_model": TRUE}
    with LoadMeter() as meter:
        alone = drift(engine, profile)
    if meter.load is not None and meter.load.disturbed:  # the suite's host is not idle
        pytest.skip("other processes shared the cores: no reading of the host to itself")
    assert alone == pytest.approx(1.3)  # the machine to itself
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        assert drift(engine, profile) == 1.0
    finally:
        busy.kill()
        busy.wait()


def test_the_drift_check_times_the_engine_itself() -> None:
    engine = make_engine(pages=4096, max_batch_tokens=512)
    first, second = check_seconds(engine), check_seconds(engine)
    assert first and second and 0.5 < first / second < 2.0


def test_a_step_shape_is_timed_on_kv_pages_written_before_it() -> None:
    # A run's decodes read K/V its prefill wrote: the shape's pages are written (zeros) first,
    # and the timed forwards write only each sequence's newest token.
    engine = make_engine(pages=256, max_batch_tokens=256)
    pool = engine.pool
    pool.data.fill_(1.0)  # stands for pages the OS has not backed yet
    time_step(engine, [1, 1], [40, 40], reps=1)
    taken = pool.pages_ever_taken
    per_token = pool.num_layers * 2 * pool.kv_heads * pool.head_dim
    assert taken == 2 * -(-40 // pool.page_size)
    assert 0 < pool.data[:, :, :taken].count_nonzero().item() <= 2 * per_token
    assert pool.data[:, :, taken:].eq(1.0).all()


def test_an_engine_too_small_for_the_drift_check_skips_it() -> None:
    small = make_engine(pages=64, max_batch_tokens=64)
    assert check_seconds(small) is None
    assert drift(small, {"fit": {"check_seconds": 0.1}, "step_model": TRUE}) == 1.0
    assert drift(small, {"fit": {}, "step_model": TRUE}) == 1.0


def test_a_profile_measured_on_plain_gemm_weights_does_not_serve_packed_ones(
        tmp_path: Path) -> None:
    """The GEMM path (weights packed for oneDNN at load, or plain) changes every step's time:
    a profile of one is measured anew for the other."""
    engine = make_engine(pages=4096, max_batch_tokens=512)
    profile, _, _ = load_or_measure(engine, tmp_path)
    assert covers(profile, engine) and profile["linear"] == linear_kind(engine)
    other = "plain" if profile["linear"] != "plain" else "onednn-packed"
    assert not covers({**profile, "linear": other}, engine)


def test_a_small_engines_cached_profile_does_not_stand_in_for_a_full_one(tmp_path: Path) -> None:
    """A test-sized engine (small KV pool, small steps) measures a few small shapes; a full
    engine of the same model, device, dtype and threads measures its own and replaces it, and
    that profile then serves the small engine too."""
    model = tiny_model()
    small = make_engine(model, pages=64, max_batch_tokens=64)
    full = make_engine(model, pages=4096, max_batch_tokens=512)
    first, path, fresh = load_or_measure(small, tmp_path)
    assert fresh and first["fit"]["shapes"] < len(step_shapes(full.kv_capacity_tokens))
    assert covers(first, small) and not covers(first, full)
    second, path2, fresh2 = load_or_measure(full, tmp_path)
    assert fresh2 and path2 == path and second["fit"]["shapes"] > first["fit"]["shapes"]
    again, _, fresh3 = load_or_measure(small, tmp_path)
    assert not fresh3 and same_measurement(again, second)


def test_every_step_cap_prefills_the_same_tokens_in_steps_within_the_cap() -> None:
    from bench.step_caps import prefill_steps

    for cap, prompt in ((512, 128), (512, 200), (2048, 512), (512, 2048), (300, 1000)):
        steps = prefill_steps(4000, cap, prompt)
        assert sum(sum(q) for q, _ in steps) == 4000
        assert all(sum(q) <= cap for q, _ in steps)
        if prompt <= cap:  # whole prompts, as many as the cap holds
            assert all(q == kv for q, kv in steps) and len(steps[0][0]) == cap // prompt
        else:  # a long prompt in chunks, each attending to the ones before it
            assert steps[0] == ([cap], [cap]) and steps[1] == ([cap], [2 * cap])
            assert max(kv[0] for _, kv in steps) == prompt
    with pytest.raises(ValueError):
        prefill_steps(4000, 0, 512)


def test_the_step_cap_bench_times_every_cap_once_per_round() -> None:
    from bench.step_caps import time_caps

    engine = make_engine(pages=1024, max_batch_tokens=256)
    seconds = time_caps(engine, [64, 256], 256, 32, rounds=2)
    assert sorted(seconds) == [64, 256]
    assert all(len(s) == 2 and min(s) > 0 for s in seconds.values())
    assert engine.pool.num_free == engine.pool.num_pages  # the borrowed pages came back


def test_the_policy_bench_keeps_every_rounds_reading_and_marks_the_slowed_ones() -> None:
    from bench.cpu_policies import _best_run, _rounds

    def report(wall: float, engine_s: float, other: float | None) -> dict:
        return {"wall_seconds": wall, "engine_seconds": engine_s, "steps": 258,
                "host_load": {"other_load": other, "steal": 0.0}}

    best = _best_run([report(217.2, 216.0, 0.4), report(28.7, 27.9, 0.01),
                      report(27.8, 27.1, None)])
    assert best["wall_seconds"] == 27.8
    assert [r["engine_seconds"] for r in best["rounds"]] == [216.0, 27.9, 27.1]
    assert _rounds(best) == "[217.2 (40% load), 28.7, 27.8]"


def test_the_policy_bench_counts_as_the_same_work_only_the_same_steps_tokens_and_cache() -> None:
    from bench.cpu_policies import _same_work

    blend = {"steps": 32, "output_tokens": 1944, "cached_tokens": 134389,
             "step_model_seconds": 28.17}
    assert _same_work({**blend, "step_model_seconds": 28.18}, blend)  # rounding of the sum
    assert not _same_work({**blend, "steps": 33}, blend)
    assert not _same_work({**blend, "cached_tokens": 132000}, blend)
    assert not _same_work({**blend, "step_model_seconds": 29.0}, blend)  # other step shapes


def test_the_first_write_of_a_kv_page_is_timed_on_pages_never_taken() -> None:
    engine = make_engine(pages=4096, max_batch_tokens=512)
    pool = engine.pool
    assert fresh_kv_seconds(engine, 1e-3) >= 0.0
    taken = pool.pages_ever_taken
    assert taken > 0 and pool.num_free == pool.num_pages  # its pages went back
    rest = pool.alloc_fresh(pool.num_pages - taken)  # none left: nothing to time it on
    assert rest is not None and fresh_kv_seconds(engine, 1e-3) == 0.0


def test_a_slow_device_times_the_first_write_on_shorter_prompts() -> None:
    fast, slow = make_engine(pages=4096), make_engine(pages=4096)
    fresh_kv_seconds(fast, 1e-3)  # a 512-token prompt takes half of FRESH_STEP_S
    fresh_kv_seconds(slow, 5e-3)  # one of 512 would take 2.5 s: 200 tokens
    ps = fast.pool.page_size
    assert fast.pool.pages_ever_taken == FRESH_TRIES * 512 // ps
    assert slow.pool.pages_ever_taken == FRESH_TRIES * 200 // ps
