"""Choosing a model's KV page size from what the architecture needs and the backend supports."""

from __future__ import annotations

import torch

from specdec.backends.base import AttentionBackend
from specdec.engine.compat import PageSizeError, describe_support
from specdec.models.base import CausalLM

# Tried in order when nothing is asked for: 16 suits paged-attention kernels (aiter needs
# multiples of 16), 64 FlashMLA-style MLA decode, 1 the page-1 MLA kernels.
_PREFERRED = (16, 64, 128, 1)


def choose_block_size(
    model: CausalLM,
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
    required = getattr(model, "required_block_size", None)
    if requested is not None:
        if not (isinstance(requested, int) and not isinstance(requested, bool) and requested >= 1):
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


def _unsupported_kinds(model: CausalLM, backend: AttentionBackend, size: int, dtype: torch.dtype) -> list[str]:
    # Describing pools has no side effect beyond binding layers to names, which the final call redoes.
    # Custom pools (an indexer's keys, say) are read by the model itself, not by the backend.
    kinds = {p.kind for p in model.kv_pools("probe", size, dtype)} & {"attention", "mla"}
    return sorted(k for k in kinds if not backend.supports_block_size(size, k))
