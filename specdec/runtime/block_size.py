"""Choosing a model's KV page size from what the architecture needs and the backend supports.

Also the vocabulary the engine's pool checks (``specdec.engine.compat``) share: which page sizes a
backend runs, said in words, and the one-line :class:`PageSizeError`.
"""

from __future__ import annotations

from typing import Iterable

import torch

from specdec.backends.base import AttentionBackend
from specdec.models.base import PagedModel
from specdec.validation import is_int

# Page sizes a backend is asked about when a message lists what it supports.
PROBE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Pool kinds an attention backend runs; other pools (an indexer's keys) are read by the model itself.
BACKEND_KINDS = ("attention", "mla")


class PageSizeError(ValueError):
    """An impossible combination of pools, page sizes and backends; the message is one line."""


def supported_sizes(backend: AttentionBackend, kind: str, sizes: Iterable[int] = PROBE_SIZES) -> list[int]:
    """The page sizes among ``sizes`` that ``backend`` runs for pools of ``kind``."""
    return [s for s in sizes if backend.supports_block_size(s, kind)]


def describe_support(backend: AttentionBackend, kind: str) -> str:
    """What page sizes ``backend`` runs for ``kind`` pools, in words (``"any mla page size"``, ...)."""
    sizes = supported_sizes(backend, kind)
    if not sizes:
        return f"no {kind} page size of {listing(PROBE_SIZES)}"
    if sizes == list(PROBE_SIZES) and all(backend.supports_block_size(s, kind) for s in (3, 5, 24, 100)):
        return f"any {kind} page size"
    return f"{kind} pages of {listing(sizes)} (of the powers of two up to {PROBE_SIZES[-1]})"


def listing(sizes: Iterable[int]) -> str:
    return ", ".join(str(s) for s in sizes)

# Tried in order when nothing is asked for: 16 suits paged-attention kernels (aiter needs
# multiples of 16), 64 FlashMLA-style MLA decode, 1 the page-1 MLA kernels.
_PREFERRED = (16, 64, 128, 1)


def choose_block_size(
    model: PagedModel,
    backend: AttentionBackend,
    requested: int | None,
    dtype: torch.dtype,
    *,
    what: str = "block_size",
) -> int:
    """The page size for ``model``'s pools: ``requested`` if given (checked), else a preferred one.

    An architecture's ``required_block_size`` (MiniMax-M3's 128) wins over the backend's taste and
    conflicts with any other request. The backend must support the size for every pool kind the
    model uses.
    """
    required = model.required_block_size
    if requested is not None:
        if not (is_int(requested) and requested >= 1):
            raise ValueError(f"{what} must be a positive int or None, got {requested!r}")
        if required is not None and requested != required:
            raise PageSizeError(
                f"{what}={requested} does not suit this architecture, which needs pages of {required} tokens; "
                f"pass {what}={required} or leave it unset"
            )
        unsupported = _unsupported_kinds(model, backend, requested, dtype)
        if unsupported:
            supports = "; ".join(describe_support(backend, kind) for kind in unsupported)
            raise PageSizeError(
                f"attention backend {backend.name!r} does not support {what}={requested} for "
                f"{'/'.join(unsupported)} pools (it supports {supports}); pick another {what} or backend"
            )
        return requested
    candidates = (required,) if required is not None else _PREFERRED
    for size in candidates:
        if not _unsupported_kinds(model, backend, size, dtype):
            return size
    raise PageSizeError(
        f"attention backend {backend.name!r} supports none of the page sizes {list(candidates)} this model can use; "
        "pick another attention backend"
    )


def _unsupported_kinds(model: PagedModel, backend: AttentionBackend, size: int, dtype: torch.dtype) -> list[str]:
    # Describing pools has no side effect beyond binding layers to names, which the final call redoes.
    # Custom pools (an indexer's keys, say) are read by the model itself, not by the backend.
    kinds = {p.kind for p in model.kv_pools("probe", size, dtype)} & set(BACKEND_KINDS)
    return sorted(k for k in kinds if not backend.supports_block_size(size, k))
