"""The engine as `blendserve run`, the worker and `blendserve profile` build it: the served model
on the chosen device, and the planner's cost model from the device profile.

The profile (runtime/profile.py) is the served model's step time measured on this device. It is
read from BLENDSERVE_PROFILE when that names a file, else from the cache under DATA_DIR/profiles/
(keyed by model, device, dtype and threads), else measured once (under a minute on a small CPU)
and cached. `none` skips it: the planner then knows the model's shape but not the device's speed.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.config import Settings

if TYPE_CHECKING:
    from runtime.engine import Engine

log = logging.getLogger("blendserve.engine")
# A worker's engine lives for hours: before a run this long after the profile's last check, its
# drift is checked again (recheck_profile).
PROFILE_RECHECK_S = 600.0


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """What the caller asked for; None = the setting's value."""

    model: str | None = None
    max_batch_tokens: int | None = None
    kv_memory_bytes: int | None = None
    device: str | None = None


def resolve_device(device: str) -> str:
    """`auto`: CUDA when a GPU is visible, else the CPU."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_engine(settings: Settings, setup: EngineSetup | None = None, *,
                 with_profile: bool = True) -> Engine:
    """Load the model, build the engine, and give it the device profile's cost model."""
    from runtime.engine import Engine, EngineConfig, default_step_tokens
    from runtime.loader import load_model

    s = setup or EngineSetup()
    started = time.monotonic()
    model = load_model(s.model or settings.model, data_dir=settings.data_dir)
    device = resolve_device(s.device or settings.device)
    engine = Engine(model, EngineConfig(
        max_batch_tokens=(s.max_batch_tokens or settings.max_batch_tokens
                          or default_step_tokens(device)),
        kv_memory_bytes=s.kv_memory_bytes if s.kv_memory_bytes is not None
        else settings.kv_memory_bytes,
        device=device,
        attention_backend=settings.attention_backend,
        overlap=settings.overlap,
    ))
    log.info("loaded %s on %s in %.1fs", engine.model_name, device, time.monotonic() - started)
    if with_profile:
        attach_profile(engine, settings)
    return engine


def attach_profile(engine: Engine, settings: Settings) -> dict[str, Any] | None:
    """Set engine.cost_model from the profile the settings name (see the module docstring)."""
    from runtime.host_load import disturbance
    from runtime.profile import cost_model_from_profile, load_or_measure

    choice = settings.profile
    if choice == "none":
        return None
    if choice == "auto":
        started = time.monotonic()
        profile, path, fresh = load_or_measure(engine, settings.data_dir)
        if fresh:
            log.info("measured the device profile in %.1fs: %s", time.monotonic() - started, path)
            if warning := disturbance(profile["fit"], f"the device profile {path}"):
                log.warning("%s", warning)
    else:
        path = Path(choice)
        profile = json.loads(path.read_text())
    engine.cost_model = cost_model_from_profile(profile)
    engine.profile_path = str(path)
    engine.profile_checked_at = time.monotonic()
    return profile


def recheck_profile(engine: Engine, settings: Settings) -> None:
    """Before a run on an engine whose cached profile was last checked PROFILE_RECHECK_S ago or
    more: load it again, drift check included (runtime/profile.py), so that a worker up for
    hours plans and predicts each run at the host's speed now. Nothing for a named profile
    file or none."""
    if settings.profile != "auto" or engine.profile_path is None:
        return
    if time.monotonic() - engine.profile_checked_at < PROFILE_RECHECK_S:
        return
    try:
        attach_profile(engine, settings)
    except (OSError, ValueError) as exc:  # the cache unwritable, say: plan with the profile held
        engine.profile_checked_at = time.monotonic()
        log.warning("could not check the device profile again: %s", exc)
