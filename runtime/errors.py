"""Runtime exceptions: recoverable ones fail a single request, fatal ones stop the engine.

Request-level problems never raise out of the engine: they become `RequestOutput.error`
(a `types.RequestError`). These classes are for the engine's own callers and internals.
"""

from __future__ import annotations


class RuntimeEngineError(Exception):
    """Base class of errors raised by runtime/."""


class OutOfKVPages(RuntimeEngineError):
    """The paged pool has no free page left (recoverable: the engine evicts or preempts)."""


class UnknownAttentionBackend(RuntimeEngineError):
    """A backend name that no module registered (fatal: a configuration mistake)."""


class EngineFatalError(RuntimeEngineError):
    """The engine cannot continue (e.g. the model raised); callers should stop the run."""
