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

A proposer tells the check what it uses through attributes it already has: its backend as
``backend`` (or ``runner.backend``, else the name in ``attention_backend``, else the target's), and,
for target pools it reads without adding layers (KV sharing), their names in ``target_pools_read``.
Target pools that gained layers during the proposer's setup are found by comparing layer counts.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import attrs

from specdec.backends.base import AttentionBackend
from specdec.cache.paged_cache import PagedKVCache
from specdec.cache.pool import PagedPool

# Page sizes a backend is asked about when a message lists what it supports.
PROBE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Pool kinds an attention backend runs; other pools (an indexer's keys) are read by the model itself.
BACKEND_KINDS = ("attention", "mla")


class PageSizeError(ValueError):
    """An impossible combination of pools, page sizes and backends; the message is one line."""


class BackendFeatureError(ValueError):
    """The target needs an attention feature its backend lacks; the message is one line."""


def check_target_backend(model, backend: AttentionBackend) -> None:
    """Raise :class:`BackendFeatureError` when ``backend`` lacks a feature the target's attention needs.

    Today the one such feature is ``custom_mask`` (MiniMax-M3's block-sparse layers select KV blocks
    per query); failing here, when the engine is built, beats failing in the middle of ``generate``.
    """
    if getattr(model, "needs_custom_mask", False) and not getattr(backend, "supports_custom_mask", False):
        raise BackendFeatureError(
            f"{type(model).__name__} needs per-query block masks (custom_mask), which attention backend "
            f"{backend.name!r} does not support; use attention_backend='torch' or 'triton'"
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


@attrs.frozen
class PoolSnapshot:
    """Pool names and layer counts before a proposer's setup, to see what the setup added."""

    layers: Mapping[str, int]

    @classmethod
    def of(cls, cache: PagedKVCache) -> "PoolSnapshot":
        return cls({name: pool.num_layers for name, pool in cache.pools.items()})


def supported_sizes(backend: AttentionBackend, kind: str, sizes: Iterable[int] = PROBE_SIZES) -> list[int]:
    """The page sizes among ``sizes`` that ``backend`` runs for pools of ``kind``."""
    return [s for s in sizes if backend.supports_block_size(s, kind)]


def describe_support(backend: AttentionBackend, kind: str) -> str:
    """What page sizes ``backend`` runs for ``kind`` pools, in words (``"any mla page size"``, ...)."""
    sizes = supported_sizes(backend, kind)
    if not sizes:
        return f"no {kind} page size of {_listing(PROBE_SIZES)}"
    if sizes == list(PROBE_SIZES) and all(backend.supports_block_size(s, kind) for s in (3, 5, 24, 100)):
        return f"any {kind} page size"
    return f"{kind} pages of {_listing(sizes)} (of the powers of two up to {PROBE_SIZES[-1]})"


def draft_backend_of(proposer, target_backend: AttentionBackend) -> AttentionBackend:
    """The backend a proposer's layers run on (see the module docstring for where it is looked up)."""
    for candidate in (getattr(proposer, "backend", None), getattr(getattr(proposer, "runner", None), "backend", None)):
        if candidate is not None and callable(getattr(candidate, "supports_block_size", None)):
            return candidate
    name = getattr(proposer, "attention_backend", None)
    if name:
        from specdec.backends import get_backend

        return get_backend(name)
    return target_backend


def proposer_pool_uses(
    cache: PagedKVCache,
    before: PoolSnapshot,
    target_pools: Sequence[PagedPool],
    proposer,
    target_backend: AttentionBackend,
) -> list[PoolUse]:
    """How the proposer set up against ``cache`` (snapshot ``before``) uses pools, with its backend."""
    target_names = {p.name for p in target_pools}
    own = [p for name, p in cache.pools.items() if name not in before.layers]
    hosts = [p for p in target_pools if p.num_layers > before.layers.get(p.name, p.num_layers)]
    read_names = [n for n in getattr(proposer, "target_pools_read", ()) or () if n in target_names]
    reads = [cache.pool(n) for n in read_names if n not in {p.name for p in hosts}]
    if not (own or hosts or reads):
        return []
    backend = draft_backend_of(proposer, target_backend)
    return (
        [PoolUse(p, "draft", backend, "own") for p in own]
        + [PoolUse(p, "draft", backend, "host") for p in hosts]
        + [PoolUse(p, "draft", backend, "read") for p in reads]
    )


def check_engine_pools(
    target_pools: Sequence[PagedPool],
    target_backend: AttentionBackend,
    draft_uses: Sequence[PoolUse] = (),
    *,
    required_block_size: int | None = None,
) -> None:
    """Raise :class:`PageSizeError` (one line) unless every backend runs every pool it uses.

    ``target_pools`` run on ``target_backend``; ``draft_uses`` are the draft's (see
    :func:`proposer_pool_uses`). ``required_block_size`` is the target architecture's fixed page size,
    if any (MiniMax-M3's 128), which limits the page sizes a fix may suggest.
    """
    target_kinds = sorted({p.kind for p in target_pools} & set(BACKEND_KINDS))
    uses = [PoolUse(p, "target", target_backend, "own") for p in target_pools] + list(draft_uses)
    for use in uses:
        pool = use.pool
        if pool.kind not in BACKEND_KINDS or use.backend.supports_block_size(pool.block_size, pool.kind):
            continue
        if use.role == "own":
            raise PageSizeError(_own_message(use))
        raise PageSizeError(_shared_message(use, target_backend, target_kinds, required_block_size))


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
        also = f" (or {_listing(common[1:])})" if len(common) > 1 else ""
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


def _listing(sizes: Sequence[int]) -> str:
    return ", ".join(str(s) for s in sizes)
