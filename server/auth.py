"""Bearer keys → projects. Every file and batch belongs to one project; with no keys configured
(loopback only, enforced by Settings) everything belongs to project "default"."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from server.errors import APIError

DEFAULT_PROJECT = "default"


def _masked(key: str) -> str:
    return key[:3] + "*" * 4 + key[-4:] if len(key) > 8 else "*" * len(key)


def project_for(authorization: str | None, key_projects: dict[str, str]) -> str:
    """The project a request acts for, or an APIError(401)."""
    if not key_projects:
        return DEFAULT_PROJECT
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise APIError(
            401,
            "You didn't provide an API key. You need to provide your API key in an Authorization "
            "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            code="missing_api_key",
        )
    for known, project in key_projects.items():
        if hmac.compare_digest(known.encode(), key.encode()):  # constant time per key
            return project
    raise APIError(401, f"Incorrect API key provided: {_masked(key)}.", code="invalid_api_key")


def current_project(request: Request) -> str:
    return project_for(
        request.headers.get("authorization"), request.app.state.settings.key_projects
    )


ProjectDep = Annotated[str, Depends(current_project)]
