"""Which failures mean "a dependency is down for now" rather than "this request or batch is bad".

The database refusing connections or restarting, Redis gone, or the data directory full are
outages: the API answers 503 (`Retry-After`, the OpenAI envelope) instead of 500, and the worker
waits and resumes instead of failing the batch it was running. Everything else is a real error.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import sqlalchemy.exc as sa_exc

log = logging.getLogger(__name__)
T = TypeVar("T")

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_SQL_OUTAGES = (
    sa_exc.OperationalError,  # connection refused or reset, server restarting, SQLite full/locked
    sa_exc.InterfaceError,  # the DBAPI connection is closed
    sa_exc.DisconnectionError,
    sa_exc.TimeoutError,  # no pooled connection came free in time
)


def is_outage(exc: BaseException) -> bool:
    """True for a dependency outage (database, Redis, full disk), looking through the causes."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_outage_itself(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def _is_outage_itself(exc: BaseException) -> bool:
    if isinstance(exc, _SQL_OUTAGES):
        return True
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return True
    try:
        import redis
    except ImportError:  # pragma: no cover - redis is a dependency
        return False
    return isinstance(exc, (redis.ConnectionError, redis.TimeoutError))


def is_disk_full(exc: BaseException) -> bool:
    current: BaseException | None = exc
    while current is not None:
        if isinstance(current, OSError) and current.errno in _DISK_FULL:
            return True
        text = str(current).lower()
        if "database or disk is full" in text or "no space left" in text:
            return True
        current = current.__cause__ or current.__context__
    return False


def retry_outages(
    fn: Callable[[], T],
    *,
    what: str,
    give_up_after_s: float,
    stop: Callable[[], bool] = lambda: False,
    first_wait_s: float = 0.1,
    max_wait_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`fn()`, retried with backoff while it fails on an outage, for up to `give_up_after_s`
    (or until `stop()`); then the last outage error is raised. Other errors raise at once."""
    deadline = time.monotonic() + give_up_after_s
    wait = first_wait_s
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_outage(exc) or stop() or time.monotonic() + wait > deadline:
                raise
            log.warning("%s: %s (%s); retrying in %.1fs", what, type(exc).__name__, exc, wait)
            sleep(wait)
            wait = min(wait * 2, max_wait_s)
