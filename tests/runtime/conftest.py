"""Session fixtures shared by runtime tests: the default model, converted once per machine.

The cache lives in $BLENDSERVE_DATA_DIR or <repo>/data (gitignored), so the GGUF conversion
(~10 s) happens on the first run only; later sessions just read the cached safetensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.config import LoadedModel
from runtime.loader import DEFAULT_MODEL, default_model_folder, load_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def cache_data_dir() -> Path:
    """Where tests cache converted models: $BLENDSERVE_DATA_DIR, else <repo>/data."""
    env = os.environ.get("BLENDSERVE_DATA_DIR")
    return Path(env) if env else REPO_ROOT / "data"


@pytest.fixture(scope="session")
def model_data_dir() -> Path:
    return cache_data_dir()


@pytest.fixture(scope="session")
def default_model_dir(model_data_dir: Path) -> Path:
    """The cached HF folder of smollm2-135m-instruct (transformers loads it too)."""
    return default_model_folder(model_data_dir)


@pytest.fixture(scope="session")
def default_model(default_model_dir: Path, model_data_dir: Path) -> LoadedModel:
    """smollm2-135m-instruct as the engine gets it (float32 weights, HFTokenizer)."""
    return load_model(DEFAULT_MODEL, data_dir=model_data_dir)
