"""Pool pages read and written as plain tensors: the page I/O the backends share.

A pool layer's entry is ``[num_blocks, block_size, *entry_shape]``, token-major, so viewed flat it is
one row per slot (``block * block_size + offset``). Writing a step's entries is then a scatter by
``slot_mapping``, and reading each request's cached tokens a gather by its block table, on any
device: the torch and aiter backends use both, the Triton backend its own write kernel and this gather.
"""

from __future__ import annotations

from typing import Mapping

import torch

from specdec.backends.base import AttentionMetadata


def scatter_slots(
    layer: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor], slot_mapping: torch.Tensor
) -> None:
    """Store ``values[entry]`` (``[T, *entry_shape]``) at ``slot_mapping`` in ``layer[entry]``."""
    for key, value in values.items():
        cache = layer[key]
        flat, value = cache.view(-1, *cache.shape[2:]), value.to(cache.dtype)
        if cache.dtype.itemsize == 1:  # fp8 pages: torch's CPU index_copy_ has no fp8 kernel; the bytes do
            flat, value = flat.view(torch.uint8), value.view(torch.uint8)
        flat.index_copy_(0, slot_mapping.to(device=cache.device, dtype=torch.int64), value)


def gather_pages(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Each request's first ``max_seq_len`` cached tokens, ``[B, max_seq_len, *entry_shape]``: its
    pages gathered whole, the rows past ``max_seq_len`` in the last one left out of the view (which is
    then not contiguous).

    Whole pages, not tokens: one index per page rather than per token reads the same bytes with a
    sixteenth of the indices at 16-token pages; the zoo llama-tiny's decode gathers at batch 8 took
    15-18% less time in the engine (bf16, 1 thread)."""
    blocks = meta.derived("pages.blocks", _blocks)  # [B * num_blocks]
    pages = cache.index_select(0, blocks).view(meta.num_requests, -1, *cache.shape[2:])
    return pages[:, : meta.max_seq_len]


def _blocks(meta: AttentionMetadata) -> torch.Tensor:
    """The pages holding each request's first ``max_seq_len`` tokens, in order, int64 ``[B * num_blocks]``."""
    num_blocks = -(-meta.max_seq_len // meta.block_size)
    return meta.block_tables[:, :num_blocks].long().reshape(-1)
