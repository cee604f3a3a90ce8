"""Object ids: a prefix, then 24 hex digits that sort by creation time (ms) so lists page stably."""

from __future__ import annotations

import os
import re
import threading
import time

_lock = threading.Lock()
_last_ms = 0
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def new_id(prefix: str) -> str:
    """`prefix` + 12 hex of a strictly increasing ms clock + 12 random hex.

    Time-ordered ids let `ORDER BY created_at, id` follow insertion order within one second.
    """
    global _last_ms
    with _lock:
        ms = max(int(time.time() * 1000), _last_ms + 1)
        _last_ms = ms
    return f"{prefix}{ms:012x}{os.urandom(6).hex()}"


def new_file_id() -> str:
    return new_id("file-")


def new_batch_id() -> str:
    return new_id("batch_")


def is_safe_id(value: str) -> bool:
    """True for ids that can name a file on disk (no separators, dots or odd characters)."""
    return bool(_ID_RE.match(value))
