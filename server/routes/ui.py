"""/ui: the batches page for people with a browser. Plain server-rendered HTML (Jinja2), a small
script that refreshes the rows every second and loads each batch's plan report, no build step.

Sign-in: scripts send `Authorization: Bearer KEY`; browsers get a key form whose POST sets the
key as an HttpOnly, SameSite=Strict cookie (honoured for GET/HEAD only, see server/auth.py). The
page shows the signed-in project's batches and nothing else, exactly as `GET /v1/batches` does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from sqlalchemy import select

from server.auth import KEY_COOKIE, current_project, match_key
from server.errors import APIError
from server.models import BatchRow
from server.routes.deps import SessionDep
from server.schemas import Batch

ASSETS = Path(__file__).resolve().parent.parent / "ui"
ROWS = 100  # newest batches shown
COOKIE_MAX_AGE_S = 7 * 24 * 3600

router = APIRouter(prefix="/ui", include_in_schema=False)
static = StaticFiles(directory=ASSETS / "static")
_templates = Environment(
    loader=FileSystemLoader(ASSETS / "templates"),
    autoescape=select_autoescape(["html"]),
    auto_reload=False,
)


def _project_or_none(request: Request) -> str | None:
    """The signed-in project; None when a browser has not signed in yet (show the key form).
    A wrong Bearer header is a script's mistake: that stays a 401 envelope."""
    keys = request.app.state.settings.key_projects
    if keys and request.headers.get("authorization") is None:
        cookie = request.cookies.get(KEY_COOKIE)
        if not cookie or match_key(cookie, keys) is None:
            return None
    return current_project(request)


def _page(name: str, status: int = 200, **values: Any) -> HTMLResponse:
    html = _templates.get_template(name).render(**values)
    return HTMLResponse(html, status_code=status, headers=_NO_STORE)


_NO_STORE = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; "
    "style-src 'self'; script-src 'self'; frame-ancestors 'none'",
}


def _rows(session: SessionDep, project: str) -> list[dict[str, Any]]:
    rows = session.scalars(
        select(BatchRow)
        .where(BatchRow.project == project)
        .order_by(BatchRow.created_at.desc(), BatchRow.id.desc())
        .limit(ROWS)
    )
    return [_view(Batch.from_row(r)) for r in rows]


def _view(b: Batch) -> dict[str, Any]:
    counts = b.request_counts
    total = counts.total if counts else 0
    done = (counts.completed + counts.failed) if counts else 0
    return {
        "batch": b,
        "done": done,
        "total": total,
        "percent": round(100 * done / total, 1) if total else 0.0,
        "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.created_at)),
    }


@router.get("", response_class=HTMLResponse)
def batches_page(request: Request, session: SessionDep) -> Response:
    project = _project_or_none(request)
    if project is None:
        return _page("login.html", 401, error=None)
    return _page(
        "batches.html",
        project=project,
        rows=_rows(session, project),
        signed_in=bool(request.cookies.get(KEY_COOKIE)),
    )


@router.get("/rows", response_class=HTMLResponse)
def batch_rows(request: Request, session: SessionDep) -> Response:
    """The table body alone: what the page's script swaps in every second."""
    project = _project_or_none(request)
    if project is None:
        raise APIError(401, "Sign in at /ui first.", code="missing_api_key")
    return _page("rows.html", rows=_rows(session, project))


@router.post("/login", response_class=HTMLResponse)
def login(request: Request, key: Annotated[str, Form(max_length=512)] = "") -> Response:
    keys = request.app.state.settings.key_projects
    key = key.strip()
    if keys and (not key or match_key(key, keys) is None):
        return _page("login.html", 401, error="That key is not valid here.")
    response = RedirectResponse("/ui", status_code=303)
    if keys:
        response.set_cookie(
            KEY_COOKIE,
            key,
            max_age=COOKIE_MAX_AGE_S,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path="/",
        )
    return response


@router.post("/logout")
def logout() -> Response:
    response = RedirectResponse("/ui", status_code=303)
    response.delete_cookie(KEY_COOKIE, path="/")
    return response
