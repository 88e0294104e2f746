"""Attention backends, selected by name: ``torch`` (reference), ``triton``, ``aiter``, or a plug-in.

Backends are looked up in one :class:`~specdec.registry.Registry`: the built-ins (imported on first
use, so optional dependencies stay optional), :func:`register_backend` in the process, and entry points
of installed distributions in group ``specdec.attention_backends`` (``name = "pkg.module:Factory"``).
A name's factory is called with no arguments for each engine built with it.
"""

from __future__ import annotations

from typing import Callable

from specdec.backends.base import AttentionBackend, AttentionMetadata
from specdec.registry import Registry

BACKENDS: Registry[Callable[[], AttentionBackend]] = Registry(
    "attention backend",
    "specdec.attention_backends",
    {
        "torch": "specdec.backends.torch_ref:TorchBackend",
        "triton": "specdec.backends.triton:TritonBackend",
        "aiter": "specdec.backends.aiter:AiterBackend",
    },
)


def register_backend(name: str, target: str | Callable[[], AttentionBackend]) -> None:
    """Make a backend selectable by ``name``; ``target`` is a factory or ``"module:attr"``."""
    BACKENDS.register(name, target)


def available_backends() -> list[str]:
    return BACKENDS.names()


def get_backend(name: str) -> AttentionBackend:
    """Instantiate the backend called ``name``; an unknown name lists the valid choices."""
    return BACKENDS.get(name)()


__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "get_backend", "register_backend"]
