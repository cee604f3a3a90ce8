"""Contract fuzzing: schemathesis generates requests from openapi.yaml (valid and invalid ones) for
every operation and checks each answer: never a 5xx, a status the spec documents, the documented
content type, and a body that matches the documented schema. Bounded: FUZZ_EXAMPLES per
operation and mode, deterministic, so the suite's time stays fixed."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server.app import create_app
from server.db import upgrade
from tests.server.conftest import make_test_settings

SPEC = Path(__file__).resolve().parents[2] / "openapi.yaml"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
KEY = "sk-fuzz-0123456789"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
RUN: collections.Counter[str] = collections.Counter()  # examples sent, per operation

schema = schemathesis.openapi.from_path(SPEC)
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], deterministic=True
)


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    settings_ = make_test_settings(
        tmp_path_factory.mktemp("fuzz") / "data", api_keys=f"{KEY}:fuzz", max_file_bytes=1 << 20
    )
    upgrade(settings_)
    yield create_app(settings_)
    print(f"\ncontract fuzzing: {sum(RUN.values())} requests over {len(RUN)} operations")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_every_answer_keeps_the_contract(case: Any, fuzz_app: Any) -> None:
    RUN[case.operation.label] += 1
    response = case.call(app=fuzz_app, headers={"Authorization": f"Bearer {KEY}"})
    case.validate_response(response, checks=CHECKS)
