"""Block-sparse attention through any backend that honours ``custom_mask``.

Each contiguous group of query heads attends only the keys its own mask marks (MiniMax-M3's
lightning indexer picks key blocks per query and per indexer head). The masks become the backends'
per-query ``custom_mask`` on copies of the metadata, so every backend that supports it runs this
exactly.
"""

from __future__ import annotations

import attrs
import torch

from specdec.backends.base import AttentionBackend, AttentionMetadata


def block_sparse_attention(
    backend: AttentionBackend,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    keep: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    **kv_scales: float,
) -> torch.Tensor:
    """Attention where head group ``g`` (of ``keep.shape[1]`` contiguous groups) sees only ``keep[:, g]``.

    ``keep`` is bool ``[T, groups, max_seq_len]``. One backend call per group, with the group's keys
    as ``custom_mask`` (ANDed with any mask the metadata already carries); groups that chose the same
    keys share one call. ``kv_scales``: an fp8 pool's ``k_scale`` / ``v_scale``, passed on.
    """
    num_heads, num_kv_heads, groups = q.shape[1], k_cache.shape[2], keep.shape[1]
    if meta.custom_mask is not None:
        keep = keep & meta.custom_mask[:, None, : meta.max_seq_len]
    if groups == 1 or bool((keep == keep[:, :1]).all()):
        masked = attrs.evolve(meta, custom_mask=keep[:, 0])
        return backend.attention(q, k_cache, v_cache, masked, scale=scale, sliding_window=sliding_window, **kv_scales)
    per_group, per_kv = num_heads // groups, num_heads // num_kv_heads
    outs = []
    for g in range(groups):
        first, last = g * per_group, (g + 1) * per_group
        kv = slice(first // per_kv, (last - 1) // per_kv + 1)
        group_meta = attrs.evolve(meta, custom_mask=keep[:, g])
        outs.append(backend.attention(
            q[:, first:last], k_cache[:, :, kv], v_cache[:, :, kv], group_meta, scale=scale,
            sliding_window=sliding_window, **kv_scales,
        ))
    return torch.cat(outs, dim=1)
