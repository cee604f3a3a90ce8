"""The OpenAI error envelope: one exception type for the routes and the handlers that translate
everything else (validation, unknown routes, crashes, a locked database) into it exactly once."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.outage import is_disk_full, is_outage

log = logging.getLogger("blendserve.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}

_NO_RETRY = frozenset({400, 401, 403, 404, 405, 409, 413, 415, 431})  # a retry cannot fix these


class APIError(Exception):
    """A client-facing error; raised by routes, rendered as the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}


def envelope(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _AsciiJSONResponse(JSONResponse):
    """Messages may quote what a client sent, unpaired surrogates included: escape, never fail."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(err: APIError) -> JSONResponse:
    headers = dict(err.headers)
    if err.status in _NO_RETRY and "x-should-retry" not in headers:
        headers["x-should-retry"] = "false"  # the SDK retries 409; a retry cannot fix these
    return _AsciiJSONResponse(
        envelope(err.message, err.type, err.param, err.code),
        status_code=err.status,
        headers=headers,
    )


def not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"No such {kind} object: {object_id}", param="id", code=None)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "value_error", "loc": (), "msg": "invalid request"}
    param = _loc_to_param(tuple(first.get("loc", ())))
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return bad_request(
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)",
            code="invalid_json",
        )
    if kind == "missing":
        return bad_request(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if param is None:
        return bad_request(
            "The request body must be a JSON object (Content-Type: application/json).",
            code="invalid_type",
        )
    if kind.endswith(("_type", "_parsing")):
        return bad_request(
            f"Invalid type for '{param}': {first.get('msg', '')}.", param=param, code="invalid_type"
        )
    return bad_request(
        f"Invalid '{param}': {first.get('msg', 'invalid value')}.",
        param=param,
        code="invalid_value",
    )


def _unavailable(exc: BaseException) -> JSONResponse:
    if is_disk_full(exc):
        message = "The server is out of storage space; please retry later."
        return error_response(APIError(503, message, headers={"Retry-After": "30"}))
    message = "The server is busy; please retry shortly."
    return error_response(APIError(503, message, headers={"Retry-After": "1"}))


def install_error_handlers(app: FastAPI) -> None:
    """Every non-2xx response leaves through one of these, as the four-key OpenAI envelope."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            msg = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            msg = f"Method {request.method} not allowed for {request.url.path}."
        else:
            msg = str(exc.detail)
        return error_response(APIError(exc.status_code, msg, headers=dict(exc.headers or {})))

    @app.exception_handler(OperationalError)
    async def _db_busy(_: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database unavailable: %s", exc.orig)
        return _unavailable(exc)

    async def _dependency(_: Request, exc: Exception) -> JSONResponse:
        """Handled here, not by the catch-all: that one re-raises into the server's log."""
        if is_outage(exc):  # the database or Redis is down, or the disk is full: retry later
            log.warning("dependency unavailable: %s: %s", type(exc).__name__, exc)
            return _unavailable(exc)
        return _internal(exc)

    for kind in _dependency_errors():
        app.add_exception_handler(kind, _dependency)

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        if is_outage(exc):
            log.warning("dependency unavailable: %s: %s", type(exc).__name__, exc)
            return _unavailable(exc)
        return _internal(exc)


def _internal(exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc)  # the traceback goes to the log, never the client
    return error_response(
        APIError(500, "The server had an error while processing your request. Sorry about that!")
    )


def _dependency_errors() -> tuple[type[Exception], ...]:
    """Exception types an outage raises (server/outage.py decides which instances are one)."""
    import redis
    import sqlalchemy.exc as sa_exc

    return (OSError, sa_exc.DBAPIError, sa_exc.TimeoutError, redis.RedisError)
