"""Registering an engine's pools: the target's, then the proposer's, checked against their backends."""

from __future__ import annotations

import attrs

from specdec.backends.base import AttentionBackend
from specdec.cache.paged_cache import PagedKVCache
from specdec.cache.quant import kv_storage_dtype
from specdec.engine.compat import check_engine_pools, check_target_backend, proposer_pool_uses
from specdec.models.base import CausalLM
from specdec.models.loader import apply_kv_scales
from specdec.proposers.base import Proposer, ProposerContext, ProposerPools
from specdec.runtime.block_size import choose_block_size

TARGET_POOL = "target"


@attrs.frozen
class EnginePools:
    """Which pools of the cache are whose: the target's (``target`` first: its length is what a request
    has cached) and what the proposer's setup declared."""

    target: tuple[str, ...]
    draft: ProposerPools = ProposerPools()

    @property
    def per_request(self) -> tuple[str, ...]:
        """Pools holding each request's own rows up to its verified length: the target's and the
        proposer's own (truncated after every step)."""
        return self.target + self.draft.own


def register_pools(
    model: CausalLM,
    cache: PagedKVCache,
    backend: AttentionBackend,
    proposer: Proposer | None,
    *,
    block_size: int | None = None,
    max_model_len: int,
    kv_cache_dtype: str = "auto",
    draft_kv_cache_dtype: str | None = None,
) -> EnginePools:
    """Register the target's pools (prefix ``"target"``) and let the proposer register its own.

    Split from building so that a caller can size the budget from the registered pools first (``LLM``
    does, for its default ``kv_cache_memory``). ``kv_cache_dtype`` / ``draft_kv_cache_dtype`` (None: the
    target's) say what the pools store (:mod:`specdec.cache.quant`). Then checks that every backend can run every pool it
    uses (:func:`specdec.engine.compat.check_engine_pools`; an impossible combination of page sizes
    raises :class:`~specdec.runtime.block_size.PageSizeError`) before any memory is allocated.
    """
    check_target_backend(model, backend)
    dtype = next(model.parameters()).dtype
    kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
    size = choose_block_size(model, backend, block_size, kv_dtype)
    pools = [cache.register(p) for p in model.kv_pools(TARGET_POOL, size, kv_dtype)]
    apply_kv_scales(model, pools)
    declared = ProposerPools()
    if proposer is not None:
        context = ProposerContext(
            target=model,
            target_pools=pools,
            cache=cache,
            backend=backend,
            dtype=dtype,
            kv_dtype=kv_storage_dtype(draft_kv_cache_dtype or kv_cache_dtype, dtype),
            device=next(model.parameters()).device,
            max_model_len=max_model_len,
        )
        declared = proposer.setup(context) or ProposerPools()
        if not isinstance(declared, ProposerPools):
            raise TypeError(
                f"{type(proposer).__name__}.setup() must return a ProposerPools (the pools it uses), "
                f"got {type(declared).__name__}"
            )
    # One backend that cannot run a pool it uses fails here, in one line.
    check_engine_pools(
        pools, backend, proposer_pool_uses(cache, declared, backend), required_block_size=model.required_block_size
    )
    return EnginePools(tuple(p.name for p in pools), declared)
