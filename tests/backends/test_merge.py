"""Attention over two KV pools merged by log-sum-exp equals attention over all keys at once.

The layout is KV sharing's: each request's prompt keys ``[0, P)`` live in pool A (the target's: its
own page size and block table, read non-causally since every query sits at or after ``P``) and its
own keys ``[P, P + n)`` in pool B (the draft's, causal, the queries being the last ``q`` of them).
The reference is dense float64 softmax attention over the concatenated keys with the causal rule on
absolute positions, computed per request without any paging.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from specdec.backends import get_backend
from specdec.backends.base import AttentionMetadata
from specdec.backends.merge import merge_attention_states
from specdec.backends.torch_ref import TorchBackend

FP64_TOL = dict(atol=1e-12, rtol=1e-12)
FP32_TOL = dict(atol=1e-5, rtol=1e-5)

# (P, n, q) per request: prompt keys in pool A, own keys in pool B, queries (the last q of the own keys).
# Ragged: an empty prompt source, own keys that are only the queries, own keys that are none at all
# (queries whose KV is kept nowhere, attending to the prompt only), a request with no query this step.
BATCH = [(37, 6, 3), (0, 4, 4), (20, 0, 2), (130, 3, 3), (9, 1, 1), (5, 2, 0)]
SMALL_BATCH = [(21, 5, 3), (0, 3, 3), (9, 0, 2), (40, 2, 2), (6, 4, 1)]


@attrs.frozen
class Pool:
    meta: AttentionMetadata
    cache: torch.Tensor  # unused slots poisoned: a kernel that reads one turns its output NaN
    clean: torch.Tensor  # the same with zeros there, for the torch reference (it gathers whole pages)


@attrs.frozen
class TwoPoolCase:
    q: torch.Tensor  # [T, H, D]
    pool_a: Pool
    pool_b: Pool
    # Per request, dense float64 keys/values [S, Hkv, D] and each query's absolute position.
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    prompt_lens: list[int]
    query_positions: list[list[int]]


def _pool(
    rows: list[torch.Tensor], query_lens: list[int], block_size: int, causal: bool, dtype, g, poison
) -> Pool:
    """Scatter each request's ``rows[i] [S_i, *entry]`` into shuffled pages of one pool."""
    seq_lens = [r.shape[0] for r in rows]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(needed) + 2  # block 0 pads the tables and is never used
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    entry = rows[0].shape[1:]
    clean = torch.zeros(num_blocks, block_size, *entry, dtype=dtype)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    table = torch.zeros(len(rows), max(max(needed), 1), dtype=torch.int32)
    slots = []
    for i, r in enumerate(rows):
        blocks = [order.pop() for _ in range(needed[i])]
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(r.shape[0]):
            clean[blocks[pos // block_size], pos % block_size] = r[pos].to(dtype)
            used[blocks[pos // block_size], pos % block_size] = True
        # Only the own pool receives this step's KV; the prompt pool's slots are written by the target.
        new = range(r.shape[0] - query_lens[i], r.shape[0]) if causal and r.shape[0] else []
        slots += [blocks[p // block_size] * block_size + p % block_size for p in new]
        slots += [-1] * (query_lens[i] - len(new))
    meta = AttentionMetadata.build(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=block_size,
        causal=causal,
    )
    mask = used.view(num_blocks, block_size, *([1] * len(entry)))
    return Pool(meta=meta, cache=clean.masked_fill(~mask, poison), clean=clean)


def make_two_pool_case(
    batch,
    *,
    page_a: int,
    page_b: int,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    v_dim: int | None = None,
    mla_rank: int | None = None,
    dtype=torch.float64,
    seed: int = 0,
    poison: float = float("nan"),
) -> TwoPoolCase:
    """Random requests split into a prompt pool and an own pool; ``mla_rank`` makes a latent pool."""
    g = torch.Generator().manual_seed(seed)
    keys, values, positions = [], [], []
    rows_a, rows_b = [], []
    for prompt_len, own, queries in batch:
        total = prompt_len + own
        if mla_rank is None:
            k = torch.randn(total, kv_heads, head_dim, generator=g, dtype=torch.float64)
            v = torch.randn(total, kv_heads, v_dim or head_dim, generator=g, dtype=torch.float64)
            # K and V of a token travel as one row [k | v] so one scatter places both.
            rows_a.append(torch.cat([k[:prompt_len], v[:prompt_len]], dim=-1))
            rows_b.append(torch.cat([k[prompt_len:], v[prompt_len:]], dim=-1))
        else:
            latent = torch.randn(total, head_dim, generator=g, dtype=torch.float64)
            k, v = latent[:, None], latent[:, None, :mla_rank]
            rows_a.append(latent[:prompt_len])
            rows_b.append(latent[prompt_len:])
        keys.append(k.to(dtype).double())
        values.append(v.to(dtype).double())
        # Queries are the last of the own keys; with no own keys they follow the prompt directly.
        first = total - queries if own else prompt_len
        positions.append(list(range(first, first + queries)))
    query_lens = [b[2] for b in batch]
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g, dtype=torch.float64).to(dtype)
    pool_a = _pool(rows_a, query_lens, page_a, False, dtype, g, poison)
    pool_b = _pool(rows_b, query_lens, page_b, True, dtype, g, poison)
    return TwoPoolCase(
        q=q,
        pool_a=pool_a,
        pool_b=pool_b,
        keys=keys,
        values=values,
        prompt_lens=[b[0] for b in batch],
        query_positions=positions,
    )


def dense_reference(case: TwoPoolCase, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 softmax attention over each request's whole key list, causal on absolute positions."""
    q = case.q.double()
    num_heads = q.shape[1]
    outs, lses, start = [], [], 0
    for k, v, positions in zip(case.keys, case.values, case.query_positions):
        group = num_heads // k.shape[1]
        qi = q[start : start + len(positions)]
        start += len(positions)
        kh = k.repeat_interleave(group, dim=1)  # [S, H, D]
        vh = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->ths", qi, kh) * scale
        pos = torch.tensor(positions, dtype=torch.long)
        visible = torch.arange(k.shape[0])[None, :] <= pos[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.einsum("ths,shd->thd", torch.softmax(scores, dim=-1), vh))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def two_pool_attention(backend, case: TwoPoolCase, *, scale, head_dim, mla_rank=None, clean=False):
    """Attention over pool A and over pool B, merged; also returns each side's ``(out, lse)``."""
    sides = []
    for pool in (case.pool_a, case.pool_b):
        cache = pool.clean if clean else pool.cache
        if mla_rank is None:
            # Separate K and V tensors, as a pool allocates them (the test scatters them as one).
            k, v = cache[..., :head_dim].contiguous(), cache[..., head_dim:].contiguous()
            sides.append(backend.attention(case.q, k, v, pool.meta, scale=scale, return_lse=True))
        else:
            sides.append(
                backend.mla_attention(case.q, cache, pool.meta, kv_lora_rank=mla_rank, scale=scale, return_lse=True)
            )
    (out_a, lse_a), (out_b, lse_b) = sides
    return merge_attention_states(out_a, lse_a, out_b, lse_b, return_lse=True), sides


# ----------------------------------------------------------------------------- merge itself


def _partials(seed: int, dtype=torch.float64):
    """Dense attention split over two disjoint random key subsets, with each part's LSE."""
    g = torch.Generator().manual_seed(seed)
    tokens, heads, keys, dim = 5, 3, 11, 8
    scores = torch.randn(tokens, heads, keys, generator=g, dtype=torch.float64) * 3
    values = torch.randn(keys, dim, generator=g, dtype=torch.float64)
    in_a = torch.rand(tokens, heads, keys, generator=g) < 0.5

    def attend(mask):
        s = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        probs = torch.softmax(s, dim=-1).nan_to_num(0.0)
        return (probs @ values).to(dtype), lse

    return attend(in_a), attend(~in_a), attend(torch.ones_like(in_a))


def test_merge_of_a_split_equals_the_whole_in_float64():
    (out_a, lse_a), (out_b, lse_b), (out, lse) = _partials(0)
    merged, merged_lse = merge_attention_states(out_a, lse_a, out_b, lse_b, return_lse=True)
    torch.testing.assert_close(merged, out, **FP64_TOL)
    torch.testing.assert_close(merged_lse, lse, **FP64_TOL)
    assert merged.dtype == torch.float64 and merged_lse.dtype == torch.float64
    # Symmetric, and the plain call returns just the output.
    torch.testing.assert_close(merge_attention_states(out_b, lse_b, out_a, lse_a), out, **FP64_TOL)


def test_merge_chains_over_three_sources():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(4, 2, 12, generator=g, dtype=torch.float64)
    values = torch.randn(12, 6, generator=g, dtype=torch.float64)
    parts = []
    for keys in (slice(0, 3), slice(3, 10), slice(10, 12)):
        s = scores[..., keys]
        parts.append((torch.softmax(s, -1) @ values[keys], torch.logsumexp(s, -1)))
    out, lse = merge_attention_states(*parts[0], *parts[1], return_lse=True)
    out = merge_attention_states(out, lse, *parts[2])
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values, **FP64_TOL)


def test_an_empty_side_contributes_nothing_even_if_its_output_is_nan():
    (out_a, lse_a), _, _ = _partials(2)
    empty_out = torch.full_like(out_a, float("nan"))
    empty_lse = torch.full_like(lse_a, float("-inf"))
    merged, merged_lse = merge_attention_states(out_a, lse_a, empty_out, empty_lse, return_lse=True)
    assert torch.equal(merged, out_a) and torch.equal(merged_lse, lse_a)
    merged = merge_attention_states(empty_out, empty_lse, out_a, lse_a)
    assert torch.equal(merged, out_a)
    # Neither side saw a key: zeros and -inf, never NaN.
    both, both_lse = merge_attention_states(empty_out, empty_lse, empty_out, empty_lse, return_lse=True)
    assert torch.equal(both, torch.zeros_like(both)) and torch.isneginf(both_lse).all()


def test_mixed_rows_and_low_precision_outputs():
    (out_a, lse_a), (out_b, lse_b), (out, _) = _partials(3)
    lse_b = lse_b.clone()
    lse_b[1, 2] = float("-inf")  # one (token, head) with nothing on side b
    merged = merge_attention_states(out_a.bfloat16(), lse_a.float(), out_b.bfloat16(), lse_b.float())
    assert merged.dtype == torch.bfloat16
    torch.testing.assert_close(merged[1, 2].double(), out_a[1, 2], atol=1e-2, rtol=1e-2)
    keep = torch.ones(merged.shape[:2], dtype=torch.bool)
    keep[1, 2] = False
    torch.testing.assert_close(merged[keep].double(), out[keep], atol=2e-2, rtol=2e-2)


def test_merge_rejects_mismatched_inputs():
    (out_a, lse_a), (out_b, lse_b), _ = _partials(4)
    with pytest.raises(ValueError, match=r"lse_b must be \[T, H\]"):
        merge_attention_states(out_a, lse_a, out_b, lse_b[:, :1])
    with pytest.raises(ValueError, match="outputs must both be"):
        merge_attention_states(out_a, lse_a, out_b[:, :, :3], lse_b)
    with pytest.raises(ValueError, match="differ in dtype"):
        merge_attention_states(out_a, lse_a, out_b.float(), lse_b)


# ----------------------------------------------------------------------------- two pools, torch


def _gqa_two_pool(batch, page_a, page_b, dtype, seed=0, poison=float("nan")):
    # GQA: 4 query heads over 2 KV heads.
    return make_two_pool_case(
        batch, page_a=page_a, page_b=page_b, num_heads=4, kv_heads=2, head_dim=16, dtype=dtype, seed=seed, poison=poison
    )


@pytest.mark.parametrize("page_a,page_b", [(128, 16), (16, 1)])
def test_torch_gqa_two_pools_equal_dense_attention(page_a, page_b):
    case = _gqa_two_pool(BATCH, page_a, page_b, torch.float64, seed=page_a + page_b)
    ref_out, ref_lse = dense_reference(case, scale=0.3)
    (out, lse), ((_, lse_a), (_, lse_b)) = two_pool_attention(
        TorchBackend(), case, scale=0.3, head_dim=16, clean=True
    )
    torch.testing.assert_close(out, ref_out, **FP64_TOL)
    torch.testing.assert_close(lse, ref_lse, **FP64_TOL)
    _check_empty_sides(case, lse_a, lse_b)


@pytest.mark.parametrize("page_a,page_b", [(128, 16), (16, 1)])
def test_torch_mla_two_pools_equal_dense_attention(page_a, page_b):
    case = make_two_pool_case(
        BATCH, page_a=page_a, page_b=page_b, num_heads=8, kv_heads=1, head_dim=40, mla_rank=32, seed=page_a
    )
    ref_out, ref_lse = dense_reference(case, scale=0.15)
    (out, lse), ((_, lse_a), (_, lse_b)) = two_pool_attention(
        TorchBackend(), case, scale=0.15, head_dim=40, mla_rank=32, clean=True
    )
    torch.testing.assert_close(out, ref_out, **FP64_TOL)
    torch.testing.assert_close(lse, ref_lse, **FP64_TOL)
    _check_empty_sides(case, lse_a, lse_b)


def _check_empty_sides(case, lse_a, lse_b):
    """Rows of a request without prompt keys (or own keys) carry -inf on that side, and only those."""
    empty_a, empty_b = [], []
    for prompt_len, positions, keys in zip(case.prompt_lens, case.query_positions, case.keys):
        empty_a += [prompt_len == 0] * len(positions)
        empty_b += [keys.shape[0] == prompt_len] * len(positions)
    for lse, empty in ((lse_a, empty_a), (lse_b, empty_b)):
        empty = torch.tensor(empty)
        assert torch.isneginf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()


def test_prompt_pool_may_hold_fewer_keys_than_queries_only_when_not_causal():
    table = torch.zeros(1, 1, dtype=torch.int32)
    slots = torch.full((3,), -1, dtype=torch.int64)
    common = dict(query_lens=[3], block_tables=table, slot_mapping=slots, block_size=4)
    AttentionMetadata.build(seq_lens=[2], causal=False, **common)
    AttentionMetadata.build(seq_lens=[0], **common)  # no keys in a causal pool: its queries see nothing there
    with pytest.raises(ValueError, match="use causal=False"):
        AttentionMetadata.build(seq_lens=[2], **common)


# ----------------------------------------------------------------------------- two pools, kernels


@pytest.fixture(scope="module")
def triton_backend():
    return get_backend("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triton_gqa_two_pools_equal_dense_attention(dtype, triton_backend):
    case = _gqa_two_pool(SMALL_BATCH, 16, 1, dtype, seed=5)
    ref_out, ref_lse = dense_reference(case, scale=0.3)
    (out, lse), ((_, lse_a), (_, lse_b)) = two_pool_attention(triton_backend, case, scale=0.3, head_dim=16)
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    assert out.dtype == dtype and lse_a.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    _check_empty_sides(case, lse_a, lse_b)


def test_triton_mla_two_pools_equal_dense_attention(triton_backend):
    case = make_two_pool_case(
        SMALL_BATCH, page_a=128, page_b=16, num_heads=8, kv_heads=1, head_dim=40, mla_rank=32, dtype=torch.float32,
        seed=6,
    )
    ref_out, ref_lse = dense_reference(case, scale=0.15)
    (out, lse), ((_, lse_a), (_, lse_b)) = two_pool_attention(
        triton_backend, case, scale=0.15, head_dim=40, mla_rank=32
    )
    torch.testing.assert_close(out.double(), ref_out, **FP32_TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **FP32_TOL)
    _check_empty_sides(case, lse_a, lse_b)


def test_aiter_mla_two_pools_equal_dense_attention():
    backend = get_backend("aiter")
    case = make_two_pool_case(
        SMALL_BATCH, page_a=16, page_b=1, num_heads=8, kv_heads=1, head_dim=40, mla_rank=32, dtype=torch.float32, seed=7
    )
    ref_out, ref_lse = dense_reference(case, scale=0.15)
    (out, lse), ((_, lse_a), (_, lse_b)) = two_pool_attention(backend, case, scale=0.15, head_dim=40, mla_rank=32)
    torch.testing.assert_close(out.double(), ref_out, **FP32_TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **FP32_TOL)
    _check_empty_sides(case, lse_a, lse_b)


def test_aiter_gqa_lse_is_refused_clearly():
    backend = get_backend("aiter")
    case = _gqa_two_pool(SMALL_BATCH, 16, 16, torch.float32)
    with pytest.raises(NotImplementedError, match="returns no log-sum-exp.*'triton' or 'torch'"):
        two_pool_attention(backend, case, scale=0.3, head_dim=16)
