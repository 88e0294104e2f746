"""The torch reference backend against dense float64 attention computed from the same K/V."""

import math

import attrs
import pytest
import torch

from specdec.backends import AttentionMetadata, get_backend
from specdec.backends.base import math_dtype
from specdec.backends import torch_ref
from specdec.backends.torch_ref import TorchBackend

SHAPES = {
    "prefill": lambda seq: seq,
    "decode": lambda seq: 1,
    "verify": lambda seq: min(4, seq),
    "chunked": lambda seq: max(1, seq // 3),
}


@pytest.fixture(params=[True, False], ids=["folded", "grouped"])
def decode_folds(request, monkeypatch):
    """Decode attention both ways, whichever this CPU runs faster (torch_ref.single_queries_fold)."""
    monkeypatch.setattr(torch_ref, "single_queries_fold", lambda *shape: request.param)
    return request.param


def paged_layout(seq_lens, block_size, num_blocks, generator):
    """Block tables over shuffled physical blocks, and the slot of every cached position."""
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, slots = [], []
    for seq in seq_lens:
        need = math.ceil(seq / block_size)
        blocks, perm = perm[:need], perm[need:]
        tables.append(blocks)
        slots.append(torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(seq)]))
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return table, slots


def dense_attention(q, k, v, scale, q_positions):
    """One request: q [Q, H, D], k/v [S, Hkv, D]; query j sits at q_positions[j] (causal)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    for j, pos in enumerate(q_positions):
        scores = torch.einsum("hd,shd->hs", q[j], k[: pos + 1]) * scale
        out[j] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[: pos + 1])
    return out


def build_case(shape, num_heads, num_kv_heads, block_size, seed, head_dim=16, v_head_dim=16):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 40, (4,), generator=g).tolist()
    query_lens = [SHAPES[shape](s) for s in seq_lens]
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 3
    table, slots = paged_layout(seq_lens, block_size, num_blocks, g)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float64, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, v_head_dim, dtype=torch.float64, generator=g)
    q = torch.randn(sum(query_lens), num_heads, head_dim, dtype=torch.float64, generator=g)
    new_slots = torch.cat([s[len(s) - ql :] for s, ql in zip(slots, query_lens)])
    meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=table,
                                   slot_mapping=new_slots, block_size=block_size)
    return q, k_cache, v_cache, meta, slots


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_attention_matches_dense(shape, num_heads, num_kv_heads, block_size, decode_folds):
    q, k_cache, v_cache, meta, slots = build_case(shape, num_heads, num_kv_heads, block_size, seed=block_size)
    out = TorchBackend().attention(q, k_cache, v_cache, meta, scale=0.25)
    start = 0
    for i, seq_slots in enumerate(slots):
        ql, seq = int(meta.query_lens[i]), int(meta.seq_lens[i])
        k = k_cache.view(-1, num_kv_heads, 16)[seq_slots]
        v = v_cache.view(-1, num_kv_heads, 16)[seq_slots]
        ref = dense_attention(q[start : start + ql], k, v, 0.25, range(seq - ql, seq))
        torch.testing.assert_close(out[start : start + ql], ref, rtol=1e-12, atol=1e-12)
        start += ql


@pytest.mark.parametrize("shape", list(SHAPES))
def test_mla_attention_matches_dense(shape):
    rank, rope, heads, block_size = 12, 4, 4, 4
    q, latent, _, meta, slots = build_case(shape, heads, 1, block_size, seed=3, head_dim=rank + rope)
    latent = latent[:, :, 0]  # [blocks, block_size, rank + rope]
    out = TorchBackend().mla_attention(q, latent, meta, kv_lora_rank=rank, scale=0.3)
    start = 0
    for i, seq_slots in enumerate(slots):
        ql, seq = int(meta.query_lens[i]), int(meta.seq_lens[i])
        lat = latent.reshape(-1, rank + rope)[seq_slots][:, None, :]
        ref = dense_attention(q[start : start + ql], lat, lat[..., :rank], 0.3, range(seq - ql, seq))
        torch.testing.assert_close(out[start : start + ql], ref, rtol=1e-12, atol=1e-12)
        start += ql


@pytest.mark.parametrize("window", [None, 3, 64])
def test_equal_length_decode_matches_dense_with_and_without_a_window(window, decode_folds):
    """Every request the same length, one query each: the backend drops the mask unless a window cuts in."""
    g = torch.Generator().manual_seed(11)
    seq_lens, block_size, heads, kv_heads = [21, 21, 21], 4, 4, 2
    num_blocks = 3 * math.ceil(21 / block_size) + 2
    table, slots = paged_layout(seq_lens, block_size, num_blocks, g)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, 16, dtype=torch.float64, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, 16, dtype=torch.float64, generator=g)
    q = torch.randn(3, heads, 16, dtype=torch.float64, generator=g)
    meta = AttentionMetadata.build(query_lens=[1, 1, 1], seq_lens=seq_lens, block_tables=table,
                                   slot_mapping=torch.stack([s[-1] for s in slots]), block_size=block_size)
    out = TorchBackend().attention(q, k_cache, v_cache, meta, scale=0.25, sliding_window=window)
    seen = 21 if window is None else min(window, 21)
    for i, seq_slots in enumerate(slots):
        k = k_cache.view(-1, kv_heads, 16)[seq_slots[21 - seen :]]
        v = v_cache.view(-1, kv_heads, 16)[seq_slots[21 - seen :]]
        ref = dense_attention(q[i : i + 1], k, v, 0.25, [seen - 1])
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-12, atol=1e-12)


def test_decode_times_its_two_forms_once_per_shape(monkeypatch):
    """The choice for one query per request is measured once per dtype and head shape, on the CPU only."""
    timed = []
    monkeypatch.setattr(torch_ref, "_SINGLE_QUERIES_FOLD", {})
    monkeypatch.setattr(torch_ref, "_runs_faster", lambda first, second: timed.append((first(), second())) or True)
    cpu = torch.device("cpu")
    assert torch_ref.single_queries_fold(torch.float32, 4, 2, 16, cpu)
    assert torch_ref.single_queries_fold(torch.float32, 4, 2, 16, cpu)
    assert len(timed) == 1
    folded, grouped = timed[0]  # the two forms it compares compute the same attention
    torch.testing.assert_close(folded, grouped)
    assert torch_ref.single_queries_fold(torch.float32, 8, 2, 16, cpu) and len(timed) == 2
    assert not torch_ref.single_queries_fold(torch.float32, 4, 2, 16, torch.device("meta")) and len(timed) == 2


def test_write_kv_places_values_at_their_slots():
    backend = get_backend("torch")
    layer = {"k": torch.zeros(3, 4, 2, 5, dtype=torch.float64), "v": torch.zeros(3, 4, 2, 5, dtype=torch.float64)}
    k, v = torch.randn(2, 2, 5, dtype=torch.float64), torch.randn(2, 2, 5, dtype=torch.float64)
    backend.write_kv(layer, {"k": k, "v": v}, torch.tensor([9, 2]))
    assert torch.equal(layer["k"][2, 1], k[0]) and torch.equal(layer["v"][0, 2], v[1])
    assert layer["k"].count_nonzero() == k.count_nonzero()


@pytest.mark.parametrize("shape", ["prefill", "verify"])
@pytest.mark.parametrize("num_heads", [2, 6])
def test_sliding_window_and_custom_mask_restrict_keys(shape, num_heads):
    """Each query sees only its own key (a window of 1, or a custom mask): the output is its own value,
    with and without grouped query heads (verify batches fold a KV head's query heads into its rows)."""
    q, k_cache, v_cache, meta, slots = build_case(shape, num_heads, 2, 4, seed=5)
    backend = TorchBackend()
    windowed = backend.attention(q, k_cache, v_cache, meta, scale=1.0, sliding_window=1)
    # A window of 1 means each query sees only its own key: output equals its own value.
    group = num_heads // 2
    query_lens = meta.query_lens.tolist()
    own_values = torch.cat([v_cache.view(-1, 2, 16)[s[len(s) - ql :]] for s, ql in zip(slots, query_lens)])
    own_values = own_values.repeat_interleave(group, dim=1)
    torch.testing.assert_close(windowed, own_values, rtol=1e-12, atol=1e-12)
    eye = torch.zeros(meta.num_query_tokens, meta.max_seq_len, dtype=torch.bool)
    start = 0
    for i, ql in enumerate(query_lens):
        seq = int(meta.seq_lens[i])
        eye[start : start + ql, :seq] = torch.eye(seq, dtype=torch.bool)[seq - ql :]
        start += ql
    masked = backend.attention(q, k_cache, v_cache, attrs.evolve(meta, custom_mask=eye), scale=1.0)
    torch.testing.assert_close(masked, own_values, rtol=1e-12, atol=1e-12)


def test_unknown_backend_lists_choices():
    with pytest.raises(ValueError, match="unknown attention backend 'nope'; choose one of"):
        get_backend("nope")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_queries_that_see_no_key_get_zeros(dtype):
    """A non-causal pool where one request holds no keys (KV sharing before the prompt is cached):
    its queries read nothing there, 0 rather than NaN, while the other request still attends."""
    g = torch.Generator().manual_seed(7)
    k_cache = torch.randn(4, 4, 2, 8, generator=g).to(dtype)
    v_cache = torch.randn(4, 4, 2, 8, generator=g).to(dtype)
    q = torch.randn(5, 4, 8, generator=g).to(dtype)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    meta = AttentionMetadata.build(query_lens=[3, 2], seq_lens=[6, 0], block_tables=table,
                                   slot_mapping=torch.arange(5), block_size=4, causal=False)
    backend = TorchBackend()
    out = backend.attention(q, k_cache, v_cache, meta, scale=0.3)
    out_lse, lse = backend.attention(q, k_cache, v_cache, meta, scale=0.3, return_lse=True)
    assert not out.isnan().any() and torch.equal(out[3:], torch.zeros_like(out[3:]))
    assert out[:3].abs().sum() > 0
    assert torch.equal(lse[3:], torch.full_like(lse[3:], float("-inf")))
    torch.testing.assert_close(out, out_lse, rtol=0.02 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


@pytest.mark.skipif(math_dtype(torch.bfloat16, torch.device("cpu")) != torch.float32,
                    reason="oneDNN has bf16 kernels on this CPU: bf16 attention runs in bf16")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_half_attention_without_half_kernels_is_float32_rounded_once(shape):
    """On a CPU without bf16 kernels, bf16 attention is float32 attention over the same bf16 values,
    rounded to bf16 once at the end (with the LSE in float32)."""
    q, k_cache, v_cache, meta, _ = build_case(shape, 4, 2, 4, seed=9)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    backend = TorchBackend()
    half, full = (q, k_cache, v_cache), (q.float(), k_cache.float(), v_cache.float())
    out, ref = (backend.attention(*x, meta, scale=0.25) for x in (half, full))
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16())
    (out, lse), (ref, ref_lse) = (backend.attention(*x, meta, scale=0.25, return_lse=True) for x in (half, full))
    assert torch.equal(out, ref.bfloat16()) and torch.equal(lse, ref_lse)
