"""GET /metrics: Prometheus text exposition (server/metrics.py builds the figures).

Who may scrape: with BLENDSERVE_METRICS_KEY set, only `Authorization: Bearer <that key>`; else,
when API keys are configured, any valid API key; with no keys at all (loopback), anyone.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from server.auth import bearer_key, match_key, project_for
from server.errors import APIError
from server.schemas import ErrorEnvelope

router = APIRouter(tags=["metrics"])


def check_scraper(request: Request) -> None:
    settings = request.app.state.settings
    authorization = request.headers.get("authorization")
    if settings.metrics_key:
        key = bearer_key(authorization)
        if key is None or match_key(key, {settings.metrics_key: "metrics"}) is None:
            raise APIError(
                401, "GET /metrics needs the metrics key as a Bearer token.", code="invalid_api_key"
            )
        return
    project_for(authorization, settings.key_projects)


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition format 0.0.4.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        401: {"model": ErrorEnvelope},
    },
)
async def metrics(request: Request) -> Response:
    """Service, per-project, per-worker engine and HTTP figures for Prometheus."""
    check_scraper(request)
    body = await run_in_threadpool(generate_latest, request.app.state.metrics_registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
