"""Whether every KV pool can run on every attention backend that uses it, checked when an engine is built.

Pools are independent: each has its own page size, so a target pool of 1-token MLA pages and a draft
pool of 16-token MHA pages coexist (nothing is unified to one page size, as vLLM's KV groups are).
A combination is impossible only when one pool is used by a backend that cannot run its page size:

- a target pool under the target's backend, or a draft pool under the draft's: ``choose_block_size``
  picks and checks these sizes when the pools are described, and :func:`check_engine_pools` checks
  them again, whatever registered the pools;
- a target pool that draft layers join (an MLA draft living in the target's MLA pool as one more
  layer) or read (KV sharing): then one page size must suit both backends. This is vLLM's "No common
  block size" failure (an aiter MLA target at page 1 beside a draft backend needing multiples of 16),
  caught before any memory is allocated and reported in one line naming both sides and the way out.

What a proposer uses is what its setup declared (:class:`~specdec.proposers.base.ProposerPools`): the
pools it owns, the target pools it joined or reads, and the backend its layers run on.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from specdec.backends.base import AttentionBackend
from specdec.cache.paged_cache import PagedKVCache
from specdec.cache.pool import PagedPool
from specdec.proposers.base import ProposerPools
from specdec.runtime.block_size import (
    BACKEND_KINDS,
    PageSizeError,
    describe_support,
    listing,
    supported_sizes,
)

# Re-exported: the page-size error is part of what an engine build can raise.
__all__ = ["BackendFeatureError", "KVDtypeError", "PageSizeError", "PoolUse", "check_engine_pools", "check_target_backend",
           "describe_support", "proposer_pool_uses"]


class BackendFeatureError(ValueError):
    """The target needs an attention feature its backend lacks; the message is one line."""


class KVDtypeError(ValueError):
    """A backend cannot read the dtype a pool stores (fp8 KV on aiter's MLA); the message is one line."""


def check_target_backend(model, backend: AttentionBackend) -> None:
    """Raise :class:`BackendFeatureError` when ``backend`` lacks a feature the target's attention needs.

    Today the one such feature is ``custom_mask`` (MiniMax-M3's block-sparse layers select KV blocks
    per query); failing here, when the engine is built, beats failing in the middle of ``generate``.
    """
    if model.needs_custom_mask and not backend.supports_custom_mask:
        raise BackendFeatureError(
            f"{type(model).__name__} needs per-query block masks (custom_mask), which attention backend "
            f"{backend.name!r} does not support; use attention_backend='torch' or 'triton'"
        )


def check_batch_invariant(*backends: AttentionBackend | None) -> None:
    """Raise :class:`BackendFeatureError` (one line) when a backend the engine attends with has no
    batch-invariant mode (``supports_batch_invariant``; see :mod:`specdec.backends.invariance`)."""
    for backend in backends:
        if backend is not None and not getattr(backend, "supports_batch_invariant", False):
            raise BackendFeatureError(
                f"attention backend {backend.name!r} has no batch-invariant mode (its kernels choose how to split a "
                "row's keys from the batch); use attention_backend='torch' or 'triton', or batch_invariant=False"
            )


@attrs.frozen
class PoolUse:
    """One backend running attention over one pool.

    ``side`` is whose backend it is (``"target"`` or ``"draft"``); ``role`` is how that side uses the
    pool: ``"own"`` (its own pool), ``"host"`` (draft layers added to a target pool) or ``"read"``
    (a draft reading a target layer's KV without writing there).
    """

    pool: PagedPool
    side: str = attrs.field(validator=attrs.validators.in_(("target", "draft")))
    backend: AttentionBackend
    role: str = attrs.field(validator=attrs.validators.in_(("own", "host", "read")))


def proposer_pool_uses(cache: PagedKVCache, declared: ProposerPools, target_backend: AttentionBackend) -> list[PoolUse]:
    """How a proposer uses pools, from what its setup declared; its layers run on ``declared.backend``."""
    backend = declared.backend or target_backend
    joined = set(declared.joined)
    return (
        [PoolUse(cache.pool(n), "draft", backend, "own") for n in declared.own]
        + [PoolUse(cache.pool(n), "draft", backend, "host") for n in declared.joined]
        + [PoolUse(cache.pool(n), "draft", backend, "read") for n in declared.read if n not in joined]
    )


def check_engine_pools(
    target_pools: Sequence[PagedPool],
    target_backend: AttentionBackend,
    draft_uses: Sequence[PoolUse] = (),
    *,
    required_block_size: int | None = None,
) -> None:
    """Raise :class:`PageSizeError` or :class:`KVDtypeError` (one line) unless every backend runs every
    pool it uses, at its page size and in its dtype.

    ``target_pools`` run on ``target_backend``; ``draft_uses`` are the draft's (see
    :func:`proposer_pool_uses`). ``required_block_size`` is the target architecture's fixed page size,
    if any (MiniMax-M3's 128), which limits the page sizes a fix may suggest.
    """
    target_kinds = sorted({p.kind for p in target_pools} & set(BACKEND_KINDS))
    uses = [PoolUse(p, "target", target_backend, "own") for p in target_pools] + list(draft_uses)
    for use in uses:
        pool = use.pool
        if pool.kind in BACKEND_KINDS and not _reads(use.backend, pool):
            raise KVDtypeError(
                f"{use.side} pool {pool.name!r} ({pool.kind}) stores {str(pool.dtype).removeprefix('torch.')}, which "
                f"the {use.side} backend {use.backend.name!r} cannot read; pick another backend or kv_cache_dtype"
            )
        if pool.kind not in BACKEND_KINDS or use.backend.supports_block_size(pool.block_size, pool.kind):
            continue
        if use.role == "own":
            raise PageSizeError(_own_message(use))
        raise PageSizeError(_shared_message(use, target_backend, target_kinds, required_block_size))


def _reads(backend: AttentionBackend, pool: PagedPool) -> bool:
    """Whether ``backend`` reads ``pool``'s dtype; a backend written before fp8 pools existed (no
    ``supports_kv_dtype``) reads the model dtypes only."""
    supports = getattr(backend, "supports_kv_dtype", None)
    return supports(pool.dtype, pool.kind) if supports is not None else not pool.quantized


def _own_message(use: PoolUse) -> str:
    pool, backend = use.pool, use.backend
    knob = "block_size" if use.side == "target" else "the speculative config's block_size"
    fits = supported_sizes(backend, pool.kind)
    other = "attention_backend" if use.side == "target" else "speculative config attention_backend"
    fix = f"set {knob} to {fits[0]} or pick another {other}" if fits else f"pick another {other}"
    return (
        f"{use.side} pool {pool.name!r} ({pool.kind}, page {pool.block_size}) cannot run on the {use.side} backend "
        f"{backend.name!r}, which supports {describe_support(backend, pool.kind)}; {fix}"
    )


def _shared_message(use: PoolUse, target_backend, target_kinds, required) -> str:
    pool, draft = use.pool, use.backend
    action = "host the draft layer" if use.role == "host" else "be read by the draft (KV sharing)"
    # A page size fixes it when the draft's backend runs it for this pool and the target's backend
    # runs it for every kind of target pool (they all share the target's block_size).
    common = [
        s
        for s in supported_sizes(draft, pool.kind)
        if all(target_backend.supports_block_size(s, k) for k in target_kinds) and required in (None, s)
    ]
    fixes = []
    if common:
        also = f" (or {listing(common[1:])})" if len(common) > 1 else ""
        fixes.append(f"set the target's block_size to {common[0]}{also}, a page size both backends run")
    fixes.append(
        f"run the draft on the target's backend (leave the speculative config's attention_backend unset or set "
        f"it to {target_backend.name!r})"
    )
    return (
        f"target pool {pool.name!r} ({pool.kind}, page {pool.block_size}, backend {target_backend.name}) cannot "
        f"{action}: draft backend {draft.name!r} supports {describe_support(draft, pool.kind)}; choose: "
        + ", or ".join(fixes)
    )
