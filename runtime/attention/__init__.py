"""Attention backends behind one interface; importing the package registers the built-in ones."""

from runtime.attention import flashinfer_backend as _flashinfer  # noqa: F401  ("flashinfer")
from runtime.attention import torch_backend as _torch_backend  # noqa: F401  (registers "torch")
from runtime.attention.base import (
    AttentionBackend,
    AttentionBatch,
    available_backends,
    make_backend,
    register_backend,
    resolve_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "available_backends",
    "make_backend",
    "register_backend",
    "resolve_backend",
]
