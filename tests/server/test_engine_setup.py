"""The device profile as the worker and `blendserve run` attach it to their engine, and a
long-lived worker's engine checking it again before a run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import runtime.profile as profile_module
from runtime.profile import write_profile
from server.engine_setup import PROFILE_RECHECK_S, attach_profile, recheck_profile
from tests.runtime.test_engine import make_engine
from tests.server.conftest import make_test_settings


def test_a_long_lived_engines_profile_is_checked_again_before_a_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(pages=4096, max_batch_tokens=512)
    settings = make_test_settings(tmp_path, profile="auto")
    first = attach_profile(engine, settings)
    assert first is not None and engine.profile_path is not None
    path = Path(engine.profile_path)
    fixed = engine.cost_model.step_fixed_s
    # The host now runs the drift check 30% slower than when the profile was measured.
    then = first["fit"]["check_seconds"]
    monkeypatch.setattr(profile_module, "check_seconds", lambda engine: then * 1.3)
    with caplog.at_level(logging.WARNING, logger="blendserve.profile"):
        recheck_profile(engine, settings)  # checked a moment ago: not again
        assert "measure it again" not in caplog.text
        engine.profile_checked_at -= PROFILE_RECHECK_S
        recheck_profile(engine, settings)
        assert "30.0% slower" in caplog.text and "measure it again" in caplog.text
    assert "drift" not in json.loads(path.read_text())  # a warning, not a rescale
    assert engine.cost_model.step_fixed_s == pytest.approx(fixed)


def test_a_named_profile_file_is_not_rechecked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(pages=4096, max_batch_tokens=512)
    first = attach_profile(engine, make_test_settings(tmp_path, profile="auto"))
    assert first is not None
    named = write_profile(tmp_path / "named.json", first)
    settings = make_test_settings(tmp_path, profile=str(named))
    attach_profile(engine, settings)
    then = first["fit"]["check_seconds"]
    monkeypatch.setattr(profile_module, "check_seconds", lambda engine: then * 1.3)
    engine.profile_checked_at -= PROFILE_RECHECK_S
    recheck_profile(engine, settings)
    assert "drift" not in json.loads(named.read_text())
