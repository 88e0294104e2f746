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
    """Each request's first ``max_seq_len`` cached tokens, ``[B, max_seq_len, *entry_shape]``."""
    slots = meta.derived("pages.key_slots", _key_slots)  # [B, max_seq_len]
    flat = cache.view(-1, *cache.shape[2:])
    return flat.index_select(0, slots.view(-1)).view(*slots.shape, *cache.shape[2:])


def _key_slots(meta: AttentionMetadata) -> torch.Tensor:
    """The slot of each request's first ``max_seq_len`` tokens, int64 ``[B, max_seq_len]`` (one gather
    per layer reads them, instead of whole pages trimmed afterwards)."""
    bs = meta.block_size
    num_blocks = -(-meta.max_seq_len // bs)
    table = meta.block_tables[:, :num_blocks].long()
    offsets = torch.arange(bs, device=table.device)
    slots = (table[:, :, None] * bs + offsets).view(table.shape[0], num_blocks * bs)
    return slots[:, : meta.max_seq_len].contiguous()
