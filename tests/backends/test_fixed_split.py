"""The batch-invariant attention path (``backends.fixed_split``) computes the same attention as the
torch backend's fast path, in float64: ragged prefill, decode, verify and chunks, GQA, MLA, sliding
windows, custom masks, the LSE, empty requests, pages of any size, keys over several splits; and it
never reads outside a request's keys (the caches' unused slots hold NaN)."""

from __future__ import annotations

import attrs
import pytest
import torch

from specdec.backends import invariance
from specdec.backends.base import AttentionMetadata
from specdec.backends.fixed_split import fixed_split_scores

LENGTHS = {"prefill": lambda s: s, "decode": lambda s: 1, "verify": lambda s: min(4, s), "chunk": lambda s: max(1, s // 3)}
SEQ_LENS = [1, 70, 200, 33]  # over one, two and four key splits


def _both(fn, case):
    """``fn(k_cache, v_cache)`` on the fast path over the clean caches, and in the batch-invariant mode
    over the poisoned ones (NaN in every slot no request holds)."""
    fast = fn(case.clean_k, case.clean_v)
    with invariance.batch_invariant():
        return fast, fn(case.k_cache, case.v_cache)


def _close(a, b):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", list(LENGTHS))
@pytest.mark.parametrize("heads,kv_heads,page", [(4, 4, 16), (6, 2, 1), (8, 1, 128)])
def test_gqa_matches_the_fast_path(shape, heads, kv_heads, page, paged_case, torch_backend):
    case = paged_case(seq_lens=SEQ_LENS, query_lens=[LENGTHS[shape](s) for s in SEQ_LENS], block_size=page,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=16, v_head_dim=8, dtype=torch.float64)
    for window in (None, 5):
        fast, mode = _both(lambda k, v: torch_backend.attention(case.q, k, v, case.meta, scale=0.3,
                                                                sliding_window=window, return_lse=True), case)
        assert not mode[0].isnan().any()
        _close(fast, mode)


def test_custom_mask_and_mla(paged_case, mla_case, torch_backend):
    case = paged_case(seq_lens=SEQ_LENS, query_lens=[1, 4, 4, 1], block_size=16, num_heads=4, num_kv_heads=2,
                      head_dim=16, dtype=torch.float64)
    mask = torch.rand(case.meta.num_query_tokens, case.meta.max_seq_len, generator=torch.Generator().manual_seed(0)) < 0.5
    meta = attrs.evolve(case.meta, custom_mask=mask)
    _close(*_both(lambda k, v: torch_backend.attention(case.q, k, v, meta, scale=0.3, return_lse=True), case))
    mla = mla_case(seq_lens=SEQ_LENS, query_lens=[1, 4, 4, 2], block_size=1, num_heads=4, kv_lora_rank=32, rope_dim=8,
                   dtype=torch.float64)
    _close(*_both(lambda k, _: torch_backend.mla_attention(mla.q, k, mla.meta, kv_lora_rank=32, scale=0.2,
                                                           return_lse=True), mla))


def test_queries_that_see_no_key_get_zeros(torch_backend):
    """A non-causal pool where one request holds no keys (KV sharing before its prompt is cached)."""
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache = torch.randn(2, 4, 4, 2, 8, generator=g, dtype=torch.float64)
    k_cache[1, 2:], v_cache[1, 2:], k_cache[2:], v_cache[2:] = (float("nan"),) * 4  # no request holds these
    q = torch.randn(5, 4, 8, generator=g, dtype=torch.float64)
    meta = AttentionMetadata.build(query_lens=[3, 2], seq_lens=[6, 0], block_tables=torch.tensor([[0, 1], [2, 0]]),
                                   slot_mapping=torch.arange(5), block_size=4, causal=False)
    with invariance.batch_invariant():
        out, lse = torch_backend.attention(q, k_cache, v_cache, meta, scale=0.3, return_lse=True)
    clean = torch_backend.attention(q, k_cache.nan_to_num(), v_cache.nan_to_num(), meta, scale=0.3, return_lse=True)
    _close(clean, (out, lse))
    assert torch.equal(out[3:], torch.zeros_like(out[3:])) and bool((lse[3:] == float("-inf")).all())


def test_fixed_split_scores_are_the_dot_products(paged_case):
    case = paged_case(seq_lens=SEQ_LENS, query_lens=[1, 4, 3, 2], block_size=16, num_heads=2, num_kv_heads=1,
                      head_dim=8, dtype=torch.float64)
    keys = torch.randn(len(SEQ_LENS), max(SEQ_LENS), 8, dtype=torch.float64)
    request = torch.repeat_interleave(torch.arange(len(SEQ_LENS)), case.meta.query_lens.long())
    expected = torch.einsum("thd,tsd->ths", case.q, keys[request])
    torch.testing.assert_close(fixed_split_scores(case.q, keys, case.meta), expected, rtol=1e-12, atol=1e-12)
