"""GET /metrics: figures from SQL, from worker snapshots (another process), and this process's
HTTP traffic; who may scrape; and, on a real `blendserve serve`, tokens/s and KV use that move
while a batch runs."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from runtime.engine import Engine, EngineConfig
from runtime.loader import DEFAULT_MODEL, load_model
from runtime.types import StepRecord
from server.config import Settings
from server.db import downgrade, make_engine, upgrade
from server.engine_monitor import STEP_BUCKETS, EngineMonitor, snapshot_dir
from server.models import BatchRow
from server.pipeline import LineResult
from tests.server import live_process
from tests.server.conftest import assert_error, batch_line, create_batch
from tests.server.test_worker import seed_batch

KEYS = "sk-alice-0123456789:alpha,sk-bob-9876543210:beta"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition as {(name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    """The one sample of `name` whose labels include `labels` (None when absent)."""
    found = [
        v for (n, ls), v in samples(text).items() if n == name and set(labels.items()) <= set(ls)
    ]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


@pytest.fixture(scope="module")
def engine() -> Engine:
    model = load_model(DEFAULT_MODEL, data_dir=live_process.REPO / "data")
    return Engine(model, EngineConfig(max_batch_tokens=256, kv_memory_bytes=4 << 20))


def _result(ok: bool, prompt: int, cached: int, output: int) -> LineResult:
    return LineResult(
        "c", 1, ok, {}, input_tokens=prompt, cached_tokens=cached, output_tokens=output
    )


# -- the worker side: EngineMonitor -----------------------------------------------------------
def test_monitor_counts_results_and_computes_windowed_rates(tmp_path: Path) -> None:
    now = [1000.0]
    monitor = EngineMonitor(tmp_path, "host:1:abc", clock=lambda: now[0])
    monitor.snapshot()  # t = 1000: the window starts empty
    for _ in range(4):
        monitor.on_result(_result(True, 100, 40, 10))
    monitor.on_result(_result(False, 0, 0, 0))
    now[0] = 1002.0
    snap = monitor.snapshot()
    assert snap["counters"] == {
        "requests_ok": 4,
        "requests_failed": 1,
        "prompt_tokens": 400,
        "cached_tokens": 160,
        "output_tokens": 40,
        "sampled_tokens": 0,
    }
    assert snap["rates"]["requests_per_s"] == pytest.approx(2.5)
    assert snap["rates"]["prompt_tokens_per_s"] == pytest.approx(200.0)
    assert snap["rates"]["output_tokens_per_s"] == pytest.approx(20.0)
    assert snap["prefix_hit_ratio"] == pytest.approx(0.4)
    now[0] = 1030.0  # idle past the window: rates fall to 0, the hit ratio is the lifetime one
    monitor.snapshot()
    now[0] = 1031.0
    idle = monitor.snapshot()
    assert idle["rates"]["output_tokens_per_s"] == 0.0
    assert idle["prefix_hit_ratio"] == pytest.approx(0.4)


def _step(seconds: float, rows: int = 1) -> StepRecord:
    return StepRecord(tokens=rows, rows=rows, pairs=0, kv_read=0, decodes=rows, seconds=seconds)


def test_monitor_histogram_buckets_step_times(tmp_path: Path) -> None:
    monitor = EngineMonitor(tmp_path, "w")
    monitor.observe_steps(_step(s, rows=2) for s in (0.0005, 0.003, 0.003, 0.2, 60.0))
    snap = monitor.snapshot()
    hist = snap["step_seconds"]
    assert hist["le"] == list(STEP_BUCKETS) and len(hist["counts"]) == len(STEP_BUCKETS) + 1
    assert sum(hist["counts"]) == 5 and hist["counts"][0] == 1 and hist["counts"][-1] == 1
    assert hist["counts"][STEP_BUCKETS.index(0.005)] == 2
    assert hist["sum"] == pytest.approx(60.2065)
    assert snap["counters"]["sampled_tokens"] == 10


def test_monitor_reads_each_logged_step_once_across_generate_calls(
    tmp_path: Path, engine: Engine
) -> None:
    from runtime.types import EngineRequest, SamplingParams

    monitor = EngineMonitor(tmp_path, "w")
    monitor.attach(engine)
    prompt = engine.tokenizer.encode("Count to three.", add_special_tokens=True)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    total = 0
    for run in range(2):
        outputs = engine.generate([EngineRequest(f"r{run}", prompt, params)])
        for _ in outputs:
            monitor.snapshot()  # mid-run reads must not count a step twice
        total += len(engine.step_log)
    snap = monitor.snapshot()
    assert sum(snap["step_seconds"]["counts"]) == total >= 2 * 3
    assert snap["counters"]["sampled_tokens"] == 2 * 3
    assert snap["kv"]["capacity_tokens"] == engine.kv_capacity_tokens
    assert snap["model"] == engine.model_name


def test_monitor_publishes_atomically_and_removes_its_snapshot_on_close(tmp_path: Path) -> None:
    monitor = EngineMonitor(tmp_path, "host:42:ff", every_s=0.05)
    monitor.start()
    path = snapshot_dir(tmp_path) / "host_42_ff.json"
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert json.loads(path.read_text())["worker_id"] == "host:42:ff"
    monitor.close()
    assert not path.exists()


# -- the API side --------------------------------------------------------------------------------
@pytest.fixture
def keyed(make_settings: Callable[..., Settings]) -> Settings:
    settings = make_settings(api_keys=KEYS, worker_stall_seconds=30)
    upgrade(settings)
    return settings


def test_metrics_need_a_key_when_keys_are_set(
    keyed: Settings, live_server_factory: Callable[[Settings], str]
) -> None:
    base = live_server_factory(keyed)
    assert_error(httpx.get(f"{base}/metrics"), 401)
    r = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer sk-bob-9876543210"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")


def test_a_metrics_key_is_the_only_way_in_when_set(
    make_settings: Callable[..., Settings], live_server_factory: Callable[[Settings], str]
) -> None:
    base = live_server_factory(make_settings(api_keys=KEYS, metrics_key="scrape-secret-1"))
    tenant = {"Authorization": "Bearer sk-alice-0123456789"}
    assert_error(httpx.get(f"{base}/metrics", headers=tenant), 401)
    ok = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer scrape-secret-1"})
    assert ok.status_code == 200 and "blendserve_database_up 1.0" in ok.text


def test_batches_queue_and_projects_come_from_sql(
    keyed: Settings, live_server_factory: Callable[[Settings], str]
) -> None:
    db = make_engine(keyed)
    lines = [json.loads(batch_line(f"r{i}")) for i in range(3)]
    waiting = seed_batch(keyed, db, lines)
    now = time.time()
    rows = {
        seed_batch(keyed, db, lines): {  # running: a live claim
            "status": "in_progress",
            "total": 10,
            "completed": 4,
            "failed": 1,
            "worker_id": "h:1:x",
            "heartbeat_at": now,
        },
        seed_batch(keyed, db, lines): {  # stalled: its worker stopped heartbeating
            "status": "in_progress",
            "total": 5,
            "worker_id": "h:1:x",
            "heartbeat_at": now - 3600,
        },
        seed_batch(keyed, db, lines): {
            "status": "completed",
            "total": 3,
            "completed": 3,
            "input_tokens": 90,
            "cached_tokens": 30,
            "output_tokens": 12,
            "project": "other",
        },
    }
    with db.begin() as conn:
        for batch_id, values in rows.items():
            conn.execute(sa.update(BatchRow).where(BatchRow.id == batch_id).values(**values))
    db.dispose()
    base = live_server_factory(keyed)
    text = httpx.get(
        f"{base}/metrics", headers={"Authorization": "Bearer sk-alice-0123456789"}
    ).text
    assert value(text, "blendserve_batches", project="proj", status="in_progress") == 2
    assert value(text, "blendserve_batches", project="proj", status="validating") == 1
    assert value(text, "blendserve_batches", project="other", status="completed") == 1
    assert value(text, "blendserve_queue_depth") == 2  # `waiting` and the stalled one
    assert value(text, "blendserve_batches_running") == 1
    assert value(text, "blendserve_requests_pending", project="proj") == 5 + 5
    assert value(text, "blendserve_project_requests", project="proj", result="completed") == 4
    assert value(text, "blendserve_project_tokens", project="other", kind="cached") == 30
    assert waiting  # seeded, counted above


def test_worker_snapshots_become_labelled_series_and_stale_ones_vanish(
    keyed: Settings, live_server_factory: Callable[[Settings], str]
) -> None:
    live = EngineMonitor(keyed.data_dir, "hostA:10:aa")
    live.observe_steps([_step(0.02)])
    live.on_result(_result(True, 50, 10, 5))
    live.publish()
    dead = EngineMonitor(keyed.data_dir, "hostB:11:bb", clock=lambda: time.time() - 600)
    dead.publish()
    base = live_server_factory(keyed)
    text = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer sk-bob-9876543210"}).text
    assert value(text, "blendserve_worker_up", worker="hostA:10:aa") == 1
    assert value(text, "blendserve_worker_up", worker="hostB:11:bb") is None
    assert value(text, "blendserve_worker_tokens_total", worker="hostA:10:aa", kind="cached") == 10
    assert value(text, "blendserve_engine_step_seconds_count", worker="hostA:10:aa") == 1
    assert (
        value(text, "blendserve_engine_step_seconds_bucket", worker="hostA:10:aa", le="0.025") == 1
    )
    assert (
        value(text, "blendserve_engine_step_seconds_bucket", worker="hostA:10:aa", le="0.01") == 0
    )


def test_http_traffic_is_counted_by_route_template(
    keyed: Settings, live_server_factory: Callable[[Settings], str]
) -> None:
    base = live_server_factory(keyed)
    auth = {"Authorization": "Bearer sk-alice-0123456789"}
    for i in range(3):
        httpx.get(f"{base}/v1/batches/batch_nope{i}", headers=auth)
    httpx.request("BREW", f"{base}/v1/batches", headers=auth)
    text = httpx.get(f"{base}/metrics", headers=auth).text
    name = "blendserve_http_requests_total"
    assert value(text, name, method="GET", route="/v1/batches/{batch_id}", status="404") == 3
    assert value(text, name, method="other", route="/v1/batches", status="405") == 1


def test_metrics_still_answer_while_the_database_is_gone(
    keyed: Settings, live_server_factory: Callable[[Settings], str]
) -> None:
    base = live_server_factory(keyed)
    downgrade(keyed, "base")
    r = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer sk-bob-9876543210"})
    assert r.status_code == 200
    assert value(r.text, "blendserve_database_up") == 0


# -- the whole thing: a real server, a real batch ------------------------------------------------
@pytest.mark.slow
def test_scraping_during_a_run_shows_tokens_per_second_and_kv_use_moving(tmp_path: Path) -> None:
    data = live_process.model_data_dir(tmp_path)
    server = live_process.Server(
        data,
        live_process.free_port(),
        tmp_path / "serve.log",
        BLENDSERVE_POLICY="fcfs",
        BLENDSERVE_PROFILE="none",  # no device measurement: this is about the figures
        BLENDSERVE_KV_MEMORY_BYTES=str(16 << 20),  # a few requests at a time: KV use moves
        BLENDSERVE_METRICS_SNAPSHOT_SECONDS="0.3",
        BLENDSERVE_WORKER_POLL_SECONDS="0.1",
        BLENDSERVE_MAX_BATCH_TOKENS="64",  # small steps: the run lasts long enough to watch
    )
    seen: dict[str, list[float]] = {"output_tps": [], "kv_used": [], "steps": [], "kv_ratio": []}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            server.wait_healthy(c)
            batch = create_batch(c, live_process.fixed_length_requests(24, "m", 48))
            deadline = time.monotonic() + 600  # hang guard
            status = batch["status"]
            while status not in live_process.TERMINAL:
                assert time.monotonic() < deadline and server.alive(), server.tail()
                text = c.get("/metrics").text
                status = c.get(f"/v1/batches/{batch['id']}").json()["status"]
                if status != "in_progress":
                    time.sleep(0.2)
                    continue
                for key, name, labels in (
                    ("output_tps", "blendserve_tokens_per_second", {"kind": "output"}),
                    ("kv_used", "blendserve_kv_cache_used_tokens", {}),
                    ("kv_ratio", "blendserve_kv_cache_usage_ratio", {}),
                    ("steps", "blendserve_engine_step_seconds_count", {}),
                ):
                    v = value(text, name, **labels)
                    if v is not None:
                        seen[key].append(v)
                time.sleep(0.3)
            final = c.get(f"/v1/batches/{batch['id']}").json()
            text = c.get("/metrics").text
    finally:
        server.stop()
    assert final["status"] == "completed", server.tail()
    print({k: sorted(set(v))[:8] for k, v in seen.items()})
    assert len(set(seen["output_tps"])) >= 3 and max(seen["output_tps"]) > 0
    assert len(set(seen["kv_used"])) >= 3 and max(seen["kv_ratio"]) > 0
    assert seen["steps"] == sorted(seen["steps"]) and seen["steps"][-1] > seen["steps"][0]
    usage = final["usage"]
    assert (
        value(text, "blendserve_project_tokens", project="default", kind="output")
        == usage["output_tokens"]
        == 24 * 48
    )
    assert value(text, "blendserve_project_requests", project="default", result="completed") == 24


def test_the_grafana_dashboard_only_uses_metrics_that_exist(
    keyed: Settings, live_server_factory: Callable[[Settings], str], engine: Engine
) -> None:
    db = make_engine(keyed)
    seed_batch(keyed, db, [json.loads(batch_line("r"))])
    db.dispose()
    monitor = EngineMonitor(keyed.data_dir, "h:1:a")
    monitor.attach(engine)
    monitor.observe_steps([_step(0.01)])
    monitor.publish()
    base = live_server_factory(keyed)
    auth = {"Authorization": "Bearer sk-bob-9876543210"}
    httpx.get(f"{base}/v1/batches", headers=auth)
    exposed = {name for name, _ in samples(httpx.get(f"{base}/metrics", headers=auth).text)}
    dashboard = json.loads((live_process.REPO / "docker" / "grafana-dashboard.json").read_text())
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"blendserve_[a-z_]+", target["expr"])
    }
    assert used and used <= exposed, used - exposed
