"""Request limits enforced before a route runs: total header size (431) and bodies that trickle
(408). Both answers are the OpenAI error envelope, and a client that keeps a connection open
without sending cannot hold a worker thread or an upload slot for ever.

A body times out when no bytes arrive for `body_idle_timeout_seconds`, or when, after that first
window, it averages under `body_min_bytes_per_second` (one byte every few seconds never trips an
idle timeout on its own). Only reads of the request body are timed: once the body is complete,
`receive()` is left alone (a streamed download waits on it for the client's disconnect).
"""

from __future__ import annotations

import time

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, error_response


class RequestLimits:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_header_bytes: int,
        idle_timeout_s: float,
        min_bytes_per_s: int,
    ) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.idle_timeout_s = idle_timeout_s
        self.min_bytes_per_s = min_bytes_per_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", []))
        if size > self.max_header_bytes:
            err = APIError(
                431,
                f"Request headers total {size} bytes; the limit is {self.max_header_bytes}.",
                code="request_header_fields_too_large",
            )
            await error_response(err)(scope, _disconnected, send)
            return
        await self.app(scope, self._timed(receive), send)

    def _timed(self, receive: Receive) -> Receive:
        started = time.monotonic()
        got = 0
        body_done = False

        async def timed_receive() -> Message:
            nonlocal got, body_done
            if body_done:
                return await receive()
            with anyio.move_on_after(self.idle_timeout_s) as scope:
                message = await receive()
            if scope.cancelled_caught:
                raise _timeout(f"No request body bytes arrived for {self.idle_timeout_s:g} s.")
            if message["type"] != "http.request":
                return message
            got += len(message.get("body", b""))
            body_done = not message.get("more_body", False)
            elapsed = time.monotonic() - started
            if (
                not body_done
                and elapsed > self.idle_timeout_s
                and got < self.min_bytes_per_s * elapsed
            ):
                raise _timeout(
                    f"The request body arrived at {got / elapsed:.0f} bytes/s; the minimum is "
                    f"{self.min_bytes_per_s} bytes/s."
                )
            return message

        return timed_receive


def _timeout(message: str) -> APIError:
    return APIError(408, message, code="request_timeout", headers={"Connection": "close"})


async def _disconnected() -> Message:
    return {"type": "http.disconnect"}
