"""Per-project request rate limits: a token bucket per project in this API process.

Off unless BLENDSERVE_RATE_LIMIT_PER_MINUTE is set. A project may spend `burst` requests at once
and then `per_minute` a minute; a request over the limit is answered 429 (`rate_limit_error`)
with `Retry-After` (whole seconds until a token is back) and OpenAI's `x-ratelimit-*` headers.
Buckets live in memory: with several API processes each enforces the limit on its own share.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from server.errors import APIError

MAX_PROJECTS = 100_000  # buckets kept; past this the fullest (idle) ones are dropped


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float  # monotonic seconds of the last refill


class RateLimiter:
    """`check(project)` spends one request or raises APIError(429)."""

    def __init__(
        self,
        per_minute: int,
        burst: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_minute < 1:
            raise ValueError("per_minute must be at least 1")
        self.per_minute = per_minute
        self.burst = burst or per_minute
        self.rate = per_minute / 60.0  # tokens per second
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()  # sync routes run in a thread pool

    def check(self, project: str) -> None:
        now = self.clock()
        with self._lock:
            bucket = self._buckets.get(project)
            if bucket is None:
                if len(self._buckets) >= MAX_PROJECTS:
                    self._forget_idle(now)
                bucket = self._buckets[project] = _Bucket(float(self.burst), now)
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
            bucket.at = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return
            wait = (1.0 - bucket.tokens) / self.rate
        raise APIError(
            429,
            f"Rate limit reached for project '{project}': {self.per_minute} requests per "
            f"minute. Please retry after {math.ceil(wait)} seconds.",
            code="rate_limit_exceeded",
            headers={
                "Retry-After": str(max(1, math.ceil(wait))),
                "x-ratelimit-limit-requests": str(self.per_minute),
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": f"{wait:.3f}s",
            },
        )

    def _forget_idle(self, now: float) -> None:
        """Drop buckets that have refilled completely: forgetting them changes nothing."""
        full = [
            k for k, b in self._buckets.items() if b.tokens + (now - b.at) * self.rate >= self.burst
        ]
        for k in full or list(self._buckets)[: len(self._buckets) // 2]:
            del self._buckets[k]
