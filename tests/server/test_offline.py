"""`blendserve run` end to end on the default model: outputs for good lines, error lines for bad
ones, every custom_id exactly once, exit codes for what cannot start."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from runtime.engine import CPU_STEP_TOKENS
from server.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
MODEL = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def model_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reuse the converted default model of the runtime tests ($BLENDSERVE_DATA_DIR or <repo>/data)."""
    data = os.environ.get("BLENDSERVE_DATA_DIR") or str(REPO_ROOT / "data")
    monkeypatch.setenv("BLENDSERVE_DATA_DIR", data)
    monkeypatch.setenv("BLENDSERVE_KV_MEMORY_BYTES", str(32 << 20))
    monkeypatch.setenv("BLENDSERVE_PROFILE", "none")  # tests/runtime/test_profile.py measures


def request(custom_id: Any, url: str = CHAT, **body: Any) -> str:
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": f"Say {custom_id}."}])
    body.setdefault("max_tokens", 3)
    body.setdefault("temperature", 0)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_run_writes_outputs_and_error_lines(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "in.jsonl"
    lines = [
        request("a"),
        request("b", model=MODEL),
        "",
        "{not json",
        request("c", max_tokens=0),  # the endpoint's 400: error file, the run goes on
        request("d", model="gpt-4o"),
        request("a"),  # duplicate of line 1
        request("e", url="/v1/completions", prompt="x"),
        json.dumps({"method": "POST", "url": CHAT, "body": {}}),  # no custom_id
        request("f", stream=True),
        request("g", n=2),
    ]
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.jsonl"

    assert main(["run", str(source), "-o", str(output)]) == 0

    outputs = read_jsonl(output)
    errors = read_jsonl(tmp_path / "out.errors.jsonl")  # the default error path
    assert sorted(r["custom_id"] for r in outputs) == ["a", "b", "g"]
    for r in outputs:
        assert r["response"]["status_code"] == 200 and r["error"] is None
        body = r["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert 1 <= body["usage"]["completion_tokens"] <= 3 * len(body["choices"])
    assert (
        len(next(r for r in outputs if r["custom_id"] == "g")["response"]["body"]["choices"]) == 2
    )

    codes = {(r["custom_id"], r["response"]["body"]["error"]["code"]) for r in errors}
    assert codes == {
        (None, "invalid_json_line"),
        ("c", "invalid_value"),
        ("d", "model_not_found"),
        ("a", "duplicate_custom_id"),
        ("e", "invalid_url"),
        (None, "missing_required_parameter"),
        ("f", "streaming_unsupported"),
    }
    assert len(errors) == 7
    for r in errors:
        assert r["response"]["status_code"] == 400 and r["error"] is None
        assert set(r["response"]["body"]["error"]) == {"message", "type", "param", "code"}
    bad_json = next(
        r for r in errors if r["response"]["body"]["error"]["code"] == "invalid_json_line"
    )
    assert bad_json["response"]["body"]["error"]["message"].startswith("Line 4:")
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert "3 succeeded, 7 failed of 10 requests" in summary


@pytest.mark.slow
def test_completions_file_with_no_errors_leaves_no_error_file(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        request("p1", url="/v1/completions", prompt="The sky is")
        + "\n"
        + request("p2", url="/v1/completions", prompt=[504, 3136])
        + "\n"
    )
    output = tmp_path / "res.jsonl"
    errors = tmp_path / "errs.jsonl"
    errors.write_text("stale\n")

    rc = main(
        [
            "run",
            str(source),
            "-o",
            str(output),
            "--errors",
            str(errors),
            "--policy",
            "dfs",
            "--max-batch-tokens",
            "64",
        ]
    )

    assert rc == 0
    outputs = read_jsonl(output)
    assert sorted(r["custom_id"] for r in outputs) == ["p1", "p2"]
    assert all(r["response"]["body"]["object"] == "text_completion" for r in outputs)
    assert not errors.exists()


def test_missing_input_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["run", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    assert rc == 2
    assert "no such input file" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_empty_input_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("\n \n")
    assert main(["run", str(source), "-o", str(tmp_path / "out.jsonl")]) == 2
    assert "empty_file" in capsys.readouterr().err


def test_output_over_the_input_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(request("a") + "\n")
    assert main(["run", str(source), "-o", str(source)]) == 2
    assert source.read_text() == request("a") + "\n"


def test_unknown_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(request("a") + "\n")
    rc = main(["run", str(source), "-o", str(tmp_path / "o.jsonl"), "--model", "no-such-model"])
    assert rc == 2
    assert "cannot load model" in capsys.readouterr().err


def test_missing_output_directory_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(request("a") + "\n")
    assert main(["run", str(source), "-o", str(tmp_path / "no" / "out.jsonl")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_profile_if_missing_keeps_a_current_cached_profile_and_reports_a_new_one(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import runtime.profile as profile_module

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("--if-missing measured where load_or_measure decides")

    calls: list[Path] = []
    fresh = iter([False, True])
    new = {"step_model": {"step_fixed_s": 0.01}, "seconds": 30.0,
           "fit": {"mean_abs_rel_error": 0.04, "calibration_mean_abs_rel_error": 0.03,
                   "other_load": 0.0}}

    def load_or_measure(engine: Any, data_dir: Path) -> tuple[dict, Path, bool]:
        calls.append(data_dir)
        return new, data_dir / "profiles" / "p.json", next(fresh)

    monkeypatch.setattr(profile_module, "measure", never)
    monkeypatch.setattr(profile_module, "load_or_measure", load_or_measure)
    assert main(["profile", "--if-missing"]) == 0
    assert "is current; kept" in capsys.readouterr().err
    assert main(["profile", "--if-missing"]) == 0  # none cached: measured (and cached) by it
    assert json.loads(capsys.readouterr().out)["step_fixed_s"] == 0.01
    assert len(calls) == 2 and calls[0] == Path(os.environ["BLENDSERVE_DATA_DIR"])


@pytest.mark.slow
def test_run_writes_the_plan_report_and_its_plot(tmp_path: Path) -> None:
    system = {"role": "system", "content": "You answer in one word. " * 12}
    lines = [request(f"q{i}", max_tokens=4, ignore_eos=True,
                     messages=[system, {"role": "user", "content": f"Name colour {i}."}])
             for i in range(6)]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    report_path = tmp_path / "plan.json"
    assert main(["run", str(source), "-o", str(tmp_path / "out.jsonl"), "--report",
                 str(report_path), "--max-step-tokens", "256"]) == 0
    report = json.loads(report_path.read_text())
    assert report["policy"] == "blend" and report["mode"] == "sharing order, full steps"
    assert report["requests"] == 6 and report["output_tokens"] == 24
    assert report["max_step_tokens"] == 256 and report["steps"] >= 4
    assert report["cached_tokens"] >= 5 * 48  # the shared system prompt, computed once
    assert report["engine_seconds"] > 0 and report["simulated_seconds"] > 0
    png = report_path.with_suffix(".png")
    assert report["steps_png"] == png.name and png.read_bytes().startswith(b"\x89PNG")


def test_run_refuses_a_step_cap_below_one(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(request("a") + "\n")
    assert main(["run", str(source), "-o", str(tmp_path / "o.jsonl"), "--max-step-tokens", "0"]) == 2
    assert "--max-step-tokens must be at least 1" in capsys.readouterr().err


def test_the_step_cap_defaults_by_device_and_the_setting_overrides_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(request("a", max_tokens=2) + "\n")
    report_path = tmp_path / "plan.json"
    for setting, cap in ((None, CPU_STEP_TOKENS), ("512", 512)):
        if setting is None:
            monkeypatch.delenv("BLENDSERVE_MAX_BATCH_TOKENS", raising=False)
        else:
            monkeypatch.setenv("BLENDSERVE_MAX_BATCH_TOKENS", setting)
        assert main(["run", str(source), "-o", str(tmp_path / "o.jsonl"), "--device", "cpu",
                     "--report", str(report_path)]) == 0
        assert json.loads(report_path.read_text())["max_step_tokens"] == cap


def test_device_auto_is_the_cpu_without_a_gpu() -> None:
    import torch

    from server.engine_setup import resolve_device

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


def test_the_report_replays_each_of_n_choices_as_a_request_of_its_own() -> None:
    from runtime.types import EngineRequest, SamplingParams
    from server.plan_report import trace_entries
    from tests.runtime.test_engine import make_engine, prompts, run

    engine = make_engine(max_batch_tokens=512)
    ps = prompts(2)
    reqs = [EngineRequest("a", ps[0], SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=2)),
            EngineRequest("b", ps[1], SamplingParams(max_tokens=4, temperature=0))]
    outs = run(engine, reqs)
    entries = trace_entries(engine, [(r, outs[r.id]) for r in reqs])
    assert [e.request.id for e in entries] == ["a", "a#1", "a#2", "b"]
    assert [e.request.prompt_token_ids for e in entries] == [ps[0]] * 3 + [ps[1]]
    assert [e.output_len for e in entries] == [
        len(c.token_ids) for r in reqs for c in outs[r.id].choices]
