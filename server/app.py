"""The FastAPI app (`create_app`) and `blendserve serve` (`serve_main`): migrate, start the
embedded worker process unless --no-worker, run uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from sqlalchemy import Engine
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.config import Settings
from server.db import make_engine, session_factory, upgrade
from server.errors import install_error_handlers
from server.limits import RequestLimits
from server.line_schemas import line_schemas
from server.metrics import HttpMetricsMiddleware, build_registry
from server.rate_limit import RateLimiter
from server.routes import batches, files, metrics, models, ui
from server.routes.files import purge_expired_files
from server.storage import FileStorage

log = logging.getLogger("blendserve.api")
MAX_JSON_BODY_BYTES = 1024 * 1024  # every body except an upload
PURGE_INTERVAL_S = 600


def create_app(settings: Settings) -> FastAPI:
    """The API over settings' database and storage. The schema must already be migrated."""
    engine = make_engine(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        purger = asyncio.create_task(_purge_expired_files_forever(app))
        yield
        purger.cancel()
        queue = app.state.queue
        if queue is not None and hasattr(queue, "close"):
            queue.close()
        engine.dispose()

    app = FastAPI(
        title="BlendServe",
        version="0.1.0",
        summary="OpenAI-compatible Files and Batches API for offline LLM inference.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = session_factory(settings, engine)
    app.state.storage = FileStorage(settings.data_dir / "files")
    app.state.queue = _make_queue(settings, engine)
    app.state.started_at = int(time.time())
    app.state.rate_limiter = (
        RateLimiter(settings.rate_limit_per_minute, settings.rate_limit_burst)
        if settings.rate_limit_per_minute
        else None
    )
    app.state.metrics_registry, http_metrics = build_registry(
        app.state.sessions,
        settings.data_dir,
        stall_seconds=settings.worker_stall_seconds,
        snapshot_seconds=settings.metrics_snapshot_seconds,
    )
    install_error_handlers(app)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(models.router)
    app.include_router(metrics.router)
    app.include_router(ui.router)
    app.mount("/ui/static", ui.static, name="ui-static")
    app.add_middleware(BodyLimit, max_bytes=MAX_JSON_BODY_BYTES)
    app.add_middleware(HttpMetricsMiddleware, metrics=http_metrics)
    app.add_middleware(
        RequestLimits,
        max_header_bytes=settings.max_header_bytes,
        idle_timeout_s=settings.body_idle_timeout_seconds,
        min_bytes_per_s=settings.body_min_bytes_per_second,
    )
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, corrected to what the server does: Bearer auth on /v1, and 400 (the
    OpenAI envelope) where FastAPI would document its 422, which this server never sends."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    components = schema.setdefault("components", {})
    components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearerAuth": []}]
    envelope_ref = {"$ref": "#/components/schemas/ErrorEnvelope"}
    for path, ops in schema["paths"].items():
        for op in ops.values():
            responses = op.get("responses", {})
            if responses.pop("422", None) is not None and "400" not in responses:
                responses["400"] = {
                    "description": "Bad Request",
                    "content": {"application/json": {"schema": envelope_ref}},
                }
            if path == "/health":
                op["security"] = []
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    components.setdefault("schemas", {}).update(line_schemas())  # what a batch file holds
    app.openapi_schema = schema
    return schema


async def _purge_expired_files_forever(app: FastAPI) -> None:
    """Reclaim expired files now and every PURGE_INTERVAL_S (in a thread: it touches disk)."""
    while True:
        try:
            n = await anyio.to_thread.run_sync(
                purge_expired_files, app.state.sessions, app.state.storage, int(time.time())
            )
            if n:
                log.info("purged %d expired files", n)
        except Exception:
            log.exception("purging expired files failed")
        await asyncio.sleep(PURGE_INTERVAL_S)


def _make_queue(settings: Settings, engine: Engine) -> Any:
    """The worker queue (server/queue.py) that `POST /v1/batches` notifies; None when it cannot be
    built: batches are rows in SQL, which workers also poll, so the API serves on without it."""
    try:
        from server.queue import make_queue
    except ImportError:
        log.warning("server.queue is not available; batches wait in SQL for a worker")
        return None
    try:
        return make_queue(settings, engine=engine)
    except Exception:
        log.exception("could not build the batch queue; batches wait in SQL for a worker")
        return None


class BodyLimit:
    """413 for a non-upload body over `max_bytes`, counted as it arrives (chunked bodies too)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] == "POST" and scope["path"] == "/v1/files"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._too_large(scope, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, f"Request body over {self.max_bytes} bytes.")
            return message

        await self.app(scope, limited, send)

    async def _too_large(self, scope: Scope, send: Send) -> None:
        from server.errors import APIError, error_response

        response = error_response(APIError(413, f"Request body over {self.max_bytes} bytes."))
        await response(scope, _empty_receive, send)


async def _empty_receive() -> Message:
    return {"type": "http.disconnect"}


def serve_main(args: argparse.Namespace) -> int:
    """`blendserve serve`: migrate, spawn the embedded worker (unless --no-worker), run uvicorn;
    the worker child is terminated when the server stops."""
    import uvicorn

    overrides = {
        k: v
        for k, v in (("host", getattr(args, "host", None)), ("port", getattr(args, "port", None)))
        if v is not None
    }
    settings = Settings(**overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    upgrade(settings)
    worker = None
    if not getattr(args, "no_worker", False):
        worker = _spawn_worker(settings)
    try:
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
    finally:
        if worker is not None:
            _stop(worker)
    return 0


def _spawn_worker(settings: Settings) -> Any:
    try:
        from server.worker import spawn_embedded_worker
    except ImportError:
        log.warning("server.worker is not available; serving the API without a worker")
        return None
    return spawn_embedded_worker(settings)


def _stop(worker: Any, grace_s: float = 10.0) -> None:
    if worker.is_alive():
        worker.terminate()
        worker.join(grace_s)
    if worker.is_alive():
        worker.kill()
        worker.join(grace_s)
