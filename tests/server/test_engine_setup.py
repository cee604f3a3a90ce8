"""The device profile as the worker and `blendserve run` attach it to their engine, and a
long-lived worker's engine checking it again before a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.profile import DRIFT_TOLERANCE, write_profile
from server.engine_setup import PROFILE_RECHECK_S, attach_profile, recheck_profile
from tests.runtime.test_engine import make_engine
from tests.server.conftest import make_test_settings


def test_a_long_lived_engines_profile_is_checked_again_before_a_run(tmp_path: Path) -> None:
    engine = make_engine(pages=4096, max_batch_tokens=512)
    settings = make_test_settings(tmp_path, profile="auto")
    first = attach_profile(engine, settings)
    assert first is not None and engine.profile_path is not None
    path = Path(engine.profile_path)
    fixed = engine.cost_model.step_fixed_s
    # As if measured when the host ran the drift check in half the time it takes now.
    write_profile(path, {**first, "fit": {**first["fit"],
                                          "check_seconds": first["fit"]["check_seconds"] / 2}})
    recheck_profile(engine, settings)  # checked a moment ago: not again
    assert "drift" not in json.loads(path.read_text())
    assert engine.cost_model.step_fixed_s == fixed
    engine.profile_checked_at -= PROFILE_RECHECK_S
    recheck_profile(engine, settings)
    ratio = json.loads(path.read_text())["drift"]["ratio"]
    assert ratio > 1.0 + DRIFT_TOLERANCE
    assert engine.cost_model.step_fixed_s == pytest.approx(fixed * ratio)


def test_a_named_profile_file_is_not_rechecked(tmp_path: Path) -> None:
    engine = make_engine(pages=4096, max_batch_tokens=512)
    first = attach_profile(engine, make_test_settings(tmp_path, profile="auto"))
    assert first is not None
    named = write_profile(tmp_path / "named.json",
                          {**first, "fit": {**first["fit"], "check_seconds": 1e-6}})
    settings = make_test_settings(tmp_path, profile=str(named))
    attach_profile(engine, settings)
    engine.profile_checked_at -= PROFILE_RECHECK_S
    recheck_profile(engine, settings)
    assert "drift" not in json.loads(named.read_text())
