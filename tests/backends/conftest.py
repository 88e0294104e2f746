"""Shared set-up of the backend kernel tests.

``TRITON_INTERPRET=1`` (without a GPU) is set by the session-wide ``tests/conftest.py``, before any
test module imports a kernel: Triton picks interpreter or compiler when a kernel is decorated.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from specdec.backends.base import AttentionMetadata


@attrs.frozen
class PagedCase:
    """A random batch laid out in shuffled pages; ``clean_*`` are the caches the reference reads."""

    meta: AttentionMetadata
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    clean_k: torch.Tensor
    clean_v: torch.Tensor


def random_layout(
    seq_lens: list[int], query_lens: list[int], block_size: int, generator: torch.Generator, spare_blocks: int = 3
) -> tuple[AttentionMetadata, torch.Tensor, int]:
    """Metadata over shuffled physical blocks; block 0 is never used (tables are padded with it).

    Returns the metadata, a bool ``[num_blocks, block_size]`` map of the slots holding real tokens,
    and the number of blocks.
    """
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(needed) + spare_blocks
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    table = torch.zeros((len(seq_lens), max(needed)), dtype=torch.int32)
    used = torch.zeros((num_blocks, block_size), dtype=torch.bool)
    slots = []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        blocks = [order.pop() for _ in range(needed[i])]
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(seq_len):
            used[blocks[pos // block_size], pos % block_size] = True
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len - query_len, seq_len)]
    meta = AttentionMetadata.build(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=block_size,
    )
    return meta, used, num_blocks


def make_case(
    *,
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    poison: float = float("nan"),
) -> PagedCase:
    """Random q/K/V in shuffled pages; every slot that holds no token is ``poison``.

    NaN poison proves a kernel never reads outside the request's tokens (one stray read of a value
    would turn an output NaN). The reference gets the same caches with zeros there instead.
    """
    g = torch.Generator().manual_seed(seed)
    meta, used, num_blocks = random_layout(seq_lens, query_lens, block_size, g)
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    clean_k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    clean_v = torch.randn(num_blocks, block_size, num_kv_heads, v_head_dim, generator=g, dtype=torch.float64)
    clean_k, clean_v = (t.to(dtype) * used[:, :, None, None] for t in (clean_k, clean_v))
    k_cache = clean_k.masked_fill(~used[:, :, None, None], poison)
    v_cache = clean_v.masked_fill(~used[:, :, None, None], poison)
    q = torch.randn(meta.num_query_tokens, num_heads, head_dim, generator=g, dtype=torch.float64).to(dtype)
    return PagedCase(meta=meta, q=q, k_cache=k_cache, v_cache=v_cache, clean_k=clean_k, clean_v=clean_v)


def make_mla_case(
    *,
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    poison: float = float("nan"),
) -> PagedCase:
    """Like :func:`make_case` for an MLA latent pool ``[blocks, page, kv_lora_rank + rope_dim]``."""
    g = torch.Generator().manual_seed(seed)
    meta, used, num_blocks = random_layout(seq_lens, query_lens, block_size, g)
    width = kv_lora_rank + rope_dim
    clean = (torch.randn(num_blocks, block_size, width, generator=g, dtype=torch.float64).to(dtype)) * used[:, :, None]
    latent = clean.masked_fill(~used[:, :, None], poison)
    q = torch.randn(meta.num_query_tokens, num_heads, width, generator=g, dtype=torch.float64).to(dtype)
    return PagedCase(meta=meta, q=q, k_cache=latent, v_cache=latent, clean_k=clean, clean_v=clean)


@pytest.fixture
def torch_backend():
    from specdec.backends.torch_ref import TorchBackend

    return TorchBackend()


@pytest.fixture
def paged_case():
    """The :func:`make_case` factory (fixtures, because test modules cannot import a conftest safely)."""
    return make_case


@pytest.fixture
def mla_case():
    """The :func:`make_mla_case` factory."""
    return make_mla_case
