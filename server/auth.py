"""Bearer keys → projects. Every file and batch belongs to one project; with no keys configured
(loopback only, enforced by Settings) everything belongs to project "default".

Keys are compared in constant time: each known key's SHA-256 against the offered key's, all of
them, every time, so neither the length nor the position of a match shows in the timing. The
batches page (`/ui`) signs in by putting the key in an HttpOnly, SameSite=Strict cookie, which
is honoured for GET/HEAD only: a forged cross-site form can never change anything with it.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request

from server.config import DEFAULT_PROJECT
from server.errors import APIError

KEY_COOKIE = "blendserve_key"
_READ_METHODS = ("GET", "HEAD")


def _masked(key: str) -> str:
    return key[:3] + "*" * 4 + key[-4:] if len(key) > 8 else "*" * len(key)


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, or None."""
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def match_key(key: str, key_projects: dict[str, str]) -> str | None:
    """The project of `key`, or None; constant time in the key and in which entry matches."""
    offered = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    found: str | None = None
    for known, project in key_projects.items():
        if hmac.compare_digest(hashlib.sha256(known.encode()).digest(), offered):
            found = project  # no early return: every key is compared
    return found


def project_for(authorization: str | None, key_projects: dict[str, str]) -> str:
    """The project a request acts for, or an APIError(401)."""
    if not key_projects:
        return DEFAULT_PROJECT
    key = bearer_key(authorization)
    if key is None:
        raise APIError(
            401,
            "You didn't provide an API key. You need to provide your API key in an Authorization "
            "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            code="missing_api_key",
        )
    project = match_key(key, key_projects)
    if project is None:
        raise APIError(401, f"Incorrect API key provided: {_masked(key)}.", code="invalid_api_key")
    return project


def request_authorization(request: Request) -> str | None:
    """The Authorization header, else (reads only) the batches page's key cookie as a Bearer."""
    header = request.headers.get("authorization")
    if header is None and request.method in _READ_METHODS:
        cookie = request.cookies.get(KEY_COOKIE)
        if cookie:
            return f"Bearer {cookie}"
    return header


def current_project(request: Request) -> str:
    """Authenticate, then spend one request of the project's rate limit (when one is set)."""
    project = project_for(request_authorization(request), request.app.state.settings.key_projects)
    limiter = getattr(request.app.state, "rate_limiter", None)
    if limiter is not None:
        limiter.check(project)
    return project


ProjectDep = Annotated[str, Depends(current_project)]
