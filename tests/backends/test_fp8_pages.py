"""fp8 KV pages (``kv_cache_dtype="fp8"``), per backend.

Attention over fp8 pages equals attention over the same KV rounded to fp8 and back (and scaled), bit
for bit on the project's backends (a backend only converts and scales what it loads, then runs its usual
arithmetic); aiter's unified_attention, which dequantizes inside its kernel, agrees with the torch
reference over the rounded KV to float32 rounding. Checked for
MHA, GQA and MLA pages, 1- to 128-token pages, both fp8 formats, with scales that are not 1; every
slot that holds no token is NaN, so a kernel reading outside a request's tokens fails.
"""

from __future__ import annotations

import pytest
import torch

from specdec.backends import get_backend
from specdec.cache.quant import quantize, round_trip

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# (seq_lens, query_lens): decode, verify and a ragged prefill + decode mix.
SHAPES = [([37, 5, 20], [1, 1, 1]), ([23, 4, 41], [4, 4, 4]), ([30, 12, 7], [6, 1, 7])]
K_SCALE, V_SCALE = 0.25, 2.0  # powers of two: scaling is exact, so the reference is exact too


@pytest.fixture(scope="module", params=["torch", "triton", "aiter"])
def backend(request):
    return get_backend(request.param)


def _fp8(cache: torch.Tensor, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages stored in ``dtype`` and what attention should read back from them."""
    return quantize(cache, scale, dtype), round_trip(cache, scale, dtype)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 4, 16, 16), (4, 2, 32, 128), (6, 2, 16, 5)],
                         ids=["mha-p16", "gqa2-p128", "gqa3-p5"])
def test_attention_over_fp8_pages_is_attention_over_rounded_kv(backend, dtype, shape, heads, kv_heads, head_dim,
                                                               block_size, paged_case, torch_backend):
    if backend.name == "aiter" and block_size == 5:
        pytest.skip("aiter's unified_attention takes pages of powers of two, multiples of 16")
    seq_lens, query_lens = SHAPES[shape]
    case = paged_case(seq_lens=seq_lens, query_lens=query_lens, block_size=block_size, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=head_dim, seed=shape)
    k_cache, v_cache = (case.clean_k, case.clean_v) if backend.name == "torch" else (case.k_cache, case.v_cache)
    k8, k_read = _fp8(k_cache, K_SCALE, dtype)
    v8, v_read = _fp8(v_cache, V_SCALE, dtype)
    out = backend.attention(case.q, k8, v8, case.meta, scale=head_dim**-0.5, k_scale=K_SCALE, v_scale=V_SCALE)
    assert not out.isnan().any()
    if backend.name == "aiter":  # its own float kernel is not the reference here: the torch backend is
        ref = torch_backend.attention(case.q, round_trip(case.clean_k, K_SCALE, dtype),
                                      round_trip(case.clean_v, V_SCALE, dtype), case.meta, scale=head_dim**-0.5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    ref = backend.attention(case.q, k_read, v_read, case.meta, scale=head_dim**-0.5)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_mla_over_fp8_latent_pages(backend, dtype, block_size, mla_case):
    if backend.name == "aiter":
        assert not backend.supports_kv_dtype(dtype, "mla") and backend.supports_kv_dtype(dtype, "attention")
        return
    case = mla_case(seq_lens=[29, 6, 17], query_lens=[4, 1, 17], block_size=block_size, num_heads=8,
                    kv_lora_rank=32, rope_dim=16, seed=block_size)
    latent8, read = _fp8(case.clean_k if backend.name == "torch" else case.k_cache, K_SCALE, dtype)
    out = backend.mla_attention(case.q, latent8, case.meta, kv_lora_rank=32, scale=0.1, latent_scale=K_SCALE)
    ref = backend.mla_attention(case.q, read, case.meta, kv_lora_rank=32, scale=0.1)
    assert not out.isnan().any()
    assert torch.equal(out, ref)


def test_writes_store_what_the_pool_encodes(backend):
    from specdec.cache.pool import AttentionPool

    pool = AttentionPool("p", num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float8_e4m3fn)
    pool.materialize(4)
    pool.set_scale(1, "v", 4.0)
    values = {"k": torch.randn(3, 2, 8) * 100, "v": torch.randn(3, 2, 8) * 1000}
    values["k"][0, 0, 0] = 1e6
    slots = torch.tensor([5, 17, 40])
    backend.write_kv(pool.layer(1), pool.encode(1, values), slots)
    for entry, scale in (("k", 1.0), ("v", 4.0)):
        stored = pool.layer(1)[entry].view(-1, 2, 8)[slots]
        assert torch.equal(pool.decode(1, entry, stored, torch.float32), round_trip(values[entry], scale, stored.dtype))
    assert pool.layer(1)["k"].view(-1, 2, 8)[slots].float().abs().max() == 448.0  # outliers saturate, never inf/NaN
