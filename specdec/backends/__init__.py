"""Attention backends, selected by name: ``torch`` (reference), ``triton``, ``aiter``."""

from __future__ import annotations

import importlib
from typing import Callable

from specdec.backends.base import AttentionBackend, AttentionMetadata

# name -> "module:factory", imported on first use so optional dependencies stay optional.
_BACKENDS: dict[str, str] = {
    "torch": "specdec.backends.torch_ref:TorchBackend",
    "triton": "specdec.backends.triton:TritonBackend",
    "aiter": "specdec.backends.aiter:AiterBackend",
}


def register_backend(name: str, target: str | Callable[[], AttentionBackend]) -> None:
    """Make a backend selectable by ``name``; ``target`` is a factory or ``"module:attr"``."""
    _BACKENDS[name] = target  # type: ignore[assignment]


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    """Instantiate the backend called ``name``; unknown names list the valid choices."""
    if isinstance(name, str) and name in _BACKENDS:
        target = _BACKENDS[name]
    else:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {available_backends()}")
    if callable(target):
        return target()
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)()


__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "get_backend", "register_backend"]
