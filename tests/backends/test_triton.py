"""The project's Triton kernels against the torch reference (under the interpreter on a CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import attrs
import pytest
import torch

from specdec.backends import get_backend
from specdec.backends.base import AttentionMetadata
from specdec.backends.triton import KernelConfig, TritonBackend

FP32_TOL = dict(atol=1e-5, rtol=1e-5)
FP64_TOL = dict(atol=1e-12, rtol=1e-12)

# (seq_lens, query_lens): decode, verify (k + 1 = 4), prefill, chunked prefill, all ragged.
SHAPES = {
    "decode": ([37, 5, 20], [1, 1, 1]),
    "verify": ([23, 4, 41], [4, 4, 4]),
    "prefill": ([9, 17], [9, 17]),
    "mixed": ([30, 12, 7], [6, 1, 7]),
}


@pytest.fixture(scope="module")
def backend():
    return get_backend("triton")


def _check(case, backend, torch_backend, *, tol=FP32_TOL, **kwargs):
    ref = torch_backend.attention(case.q, case.clean_k, case.clean_v, case.meta, **kwargs)
    out = backend.attention(case.q, case.k_cache, case.v_cache, case.meta, **kwargs)
    assert out.shape == ref.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(4, 4, 16, 16), (4, 2, 48, 5), (8, 2, 80, 1), (6, 2, 24, 8)],
    ids=["mha-d16-p16", "gqa2-d48-p5", "gqa4-d80-p1", "gqa3-d24-p8"],
)
def test_attention_matches_reference(shape, heads, kv_heads, head_dim, block_size, backend, torch_backend, paged_case):
    seq_lens, query_lens = SHAPES[shape]
    case = paged_case(
        seq_lens=seq_lens,
        query_lens=query_lens,
        block_size=block_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        seed=hash((shape, head_dim)) % 1000,
    )
    _check(case, backend, torch_backend, scale=head_dim**-0.5)


def test_float64_is_exact(backend, torch_backend, paged_case):
    case = paged_case(
        seq_lens=[40, 13], query_lens=[4, 13], block_size=8, num_heads=4, num_kv_heads=2, head_dim=24, dtype=torch.float64
    )
    _check(case, backend, torch_backend, tol=FP64_TOL, scale=0.2)


def test_values_narrower_than_keys(backend, torch_backend, paged_case):
    case = paged_case(
        seq_lens=[19, 33], query_lens=[3, 1], block_size=4, num_heads=4, num_kv_heads=2, head_dim=40, v_head_dim=24
    )
    _check(case, backend, torch_backend, scale=0.15)


@pytest.mark.parametrize("window", [1, 5, 64])
def test_sliding_window(window, backend, torch_backend, paged_case):
    case = paged_case(seq_lens=[45, 9, 30], query_lens=[4, 9, 1], block_size=4, num_heads=4, num_kv_heads=2, head_dim=16)
    _check(case, backend, torch_backend, scale=0.25, sliding_window=window)


def _with_meta(case, **changes):
    return attrs.evolve(case, meta=attrs.evolve(case.meta, **changes))


def test_tree_mask_and_a_fully_masked_row(backend, torch_backend, paged_case):
    case = paged_case(seq_lens=[26, 11], query_lens=[5, 3], block_size=4, num_heads=2, num_kv_heads=1, head_dim=16)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(case.meta.num_query_tokens, case.meta.max_seq_len + 3, generator=g) < 0.6
    mask[2] = False  # a row that sees nothing must come out as zeros, like the reference
    case = _with_meta(case, custom_mask=mask)
    _check(case, backend, torch_backend, scale=0.25)
    out = backend.attention(case.q, case.k_cache, case.v_cache, case.meta, scale=0.25)
    assert torch.all(out[2] == 0)


def test_non_causal(backend, torch_backend, paged_case):
    case = paged_case(seq_lens=[21, 6], query_lens=[21, 6], block_size=8, num_heads=2, num_kv_heads=2, head_dim=16)
    _check(_with_meta(case, causal=False), backend, torch_backend, scale=0.25)


@pytest.mark.parametrize("splits", [2, 8])
def test_split_kv_matches(splits, torch_backend, paged_case):
    backend = TritonBackend(KernelConfig(num_splits=splits, block_n=16))
    case = paged_case(seq_lens=[70, 3, 50], query_lens=[1, 1, 4], block_size=16, num_heads=4, num_kv_heads=1, head_dim=32)
    _check(case, backend, torch_backend, scale=32**-0.5)
    _check(case, backend, torch_backend, scale=32**-0.5, sliding_window=9)


def test_bfloat16_close(backend, torch_backend, paged_case):
    case = paged_case(
        seq_lens=[33, 8], query_lens=[4, 1], block_size=16, num_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16
    )
    ref = torch_backend.attention(case.q.double(), case.clean_k.double(), case.clean_v.double(), case.meta, scale=0.18)
    out = backend.attention(case.q, case.k_cache, case.v_cache, case.meta, scale=0.18)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


# ----------------------------------------------------------------------------- MLA


@pytest.mark.parametrize("shape", ["decode", "verify", "prefill", "mixed"])
@pytest.mark.parametrize(
    "heads,rank,rope,block_size", [(8, 32, 16, 16), (16, 24, 8, 1), (3, 40, 16, 6)], ids=["h8-48-p16", "h16-32-p1", "h3-56-p6"]
)
def test_mla_matches_reference(shape, heads, rank, rope, block_size, backend, torch_backend, mla_case):
    seq_lens, query_lens = SHAPES[shape]
    case = mla_case(
        seq_lens=seq_lens, query_lens=query_lens, block_size=block_size, num_heads=heads, kv_lora_rank=rank, rope_dim=rope
    )
    ref = torch_backend.mla_attention(case.q, case.clean_k, case.meta, kv_lora_rank=rank, scale=0.1)
    out = backend.mla_attention(case.q, case.k_cache, case.meta, kv_lora_rank=rank, scale=0.1)
    assert out.shape == (case.meta.num_query_tokens, heads, rank)
    torch.testing.assert_close(out, ref, **FP32_TOL)


@pytest.mark.parametrize("dtype,splits", [(torch.float32, 4), (torch.float64, 1), (torch.float64, 2)])
def test_mla_splits_and_float64(dtype, splits, torch_backend, mla_case):
    backend = TritonBackend(KernelConfig(num_splits=splits, block_n=16))
    case = mla_case(
        seq_lens=[60, 17], query_lens=[4, 1], block_size=4, num_heads=16, kv_lora_rank=32, rope_dim=16, dtype=dtype
    )
    ref = torch_backend.mla_attention(case.q, case.clean_k, case.meta, kv_lora_rank=32, scale=0.1)
    out = backend.mla_attention(case.q, case.k_cache, case.meta, kv_lora_rank=32, scale=0.1)
    torch.testing.assert_close(out, ref, **(FP64_TOL if dtype == torch.float64 else FP32_TOL))


# ----------------------------------------------------------------------------- page writes


def _write_case(block_size: int):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, num_tokens = 20, 9
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[4] = -1  # a padding token: nothing may be written for it
    layer = {
        "k": torch.randn(num_blocks, block_size, 2, 5, generator=g),
        "v": torch.randn(num_blocks, block_size, 2, 3, generator=g),
        "latent": torch.randn(num_blocks, block_size, 7, generator=g).to(torch.bfloat16),
    }
    values = {
        "k": torch.randn(num_tokens, 2, 5, generator=g),
        "v": torch.randn(num_tokens, 2, 3, generator=g),
        "latent": torch.randn(num_tokens, 7, generator=g),  # cast to the cache dtype on write
    }
    return layer, values, slots


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_write_kv(block_size, backend):
    layer, values, slots = _write_case(block_size)
    expected = {key: tensor.clone() for key, tensor in layer.items()}
    keep = slots >= 0
    for key, value in values.items():
        flat = expected[key].view(-1, *expected[key].shape[2:])
        flat[slots[keep]] = value[keep].to(flat.dtype)
    backend.write_kv(layer, values, slots)
    for key in layer:
        assert torch.equal(layer[key], expected[key]), key


def test_write_then_attend_roundtrip(backend, torch_backend, paged_case):
    """Writing this step's K/V with the kernel and attending gives the reference's answer."""
    case = paged_case(seq_lens=[12, 7], query_lens=[3, 2], block_size=4, num_heads=2, num_kv_heads=1, head_dim=16)
    slots = case.meta.slot_mapping
    flat_k = case.clean_k.view(-1, *case.clean_k.shape[2:])
    flat_v = case.clean_v.view(-1, *case.clean_v.shape[2:])
    new_k, new_v = flat_k[slots].clone(), flat_v[slots].clone()
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = float("nan")
    v_cache.view(-1, *v_cache.shape[2:])[slots] = float("nan")
    backend.write_kv({"k": k_cache, "v": v_cache}, {"k": new_k, "v": new_v}, slots)
    out = backend.attention(case.q, k_cache, v_cache, case.meta, scale=0.25)
    ref = torch_backend.attention(case.q, case.clean_k, case.clean_v, case.meta, scale=0.25)
    torch.testing.assert_close(out, ref, **FP32_TOL)


# ----------------------------------------------------------------------------- surface


def test_selection_and_page_sizes(backend):
    assert isinstance(backend, TritonBackend) and backend.name == "triton"
    for size in (1, 3, 16, 64, 128):
        assert backend.supports_block_size(size, "attention") and backend.supports_block_size(size, "mla")
    assert not backend.supports_block_size(0, "attention")
    assert not backend.supports_block_size(16, "linear")


def test_bad_config_and_shapes_fail_clearly(backend, paged_case):
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        KernelConfig(block_m=24)
    case = paged_case(seq_lens=[5], query_lens=[1], block_size=4, num_heads=3, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="not a multiple"):
        backend.attention(case.q, case.k_cache, case.v_cache, case.meta, scale=1.0)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        backend.mla_attention(case.q[:, :2], case.k_cache[:, :, 0], case.meta, kv_lora_rank=16, scale=1.0)


def test_without_gpu_or_interpreter_says_how_to_fix():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present, so the backend runs compiled")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from specdec.backends import get_backend; get_backend('triton')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "TritonUnavailableError" in last and "TRITON_INTERPRET=1" in last and "GPU" in last


def test_kernel_benchmark_without_gpu_exits_cleanly(capsys):
    if torch.cuda.is_available():
        pytest.skip("with a GPU the benchmark times for real")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 0
    assert "needs a GPU" in capsys.readouterr().out


# ----------------------------------------------------------------------------- log-sum-exp outputs


def _check_lse(case, backend, torch_backend, *, tol=FP32_TOL, mla_rank=None, **kwargs):
    if mla_rank is None:
        ref_out, ref_lse = torch_backend.attention(
            case.q, case.clean_k, case.clean_v, case.meta, return_lse=True, **kwargs
        )
        out, lse = backend.attention(case.q, case.k_cache, case.v_cache, case.meta, return_lse=True, **kwargs)
        plain = backend.attention(case.q, case.k_cache, case.v_cache, case.meta, **kwargs)
    else:
        ref_out, ref_lse = torch_backend.mla_attention(
            case.q, case.clean_k, case.meta, kv_lora_rank=mla_rank, return_lse=True, **kwargs
        )
        out, lse = backend.mla_attention(
            case.q, case.k_cache, case.meta, kv_lora_rank=mla_rank, return_lse=True, **kwargs
        )
        plain = backend.mla_attention(case.q, case.k_cache, case.meta, kv_lora_rank=mla_rank, **kwargs)
    expected_dtype = torch.float64 if case.q.dtype == torch.float64 else torch.float32
    assert lse.shape == out.shape[:2] and lse.dtype == expected_dtype and lse.is_contiguous()
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    # Asking for the LSE changes nothing about the output.
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)
    return lse


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("shape", ["verify", "mixed"])
def test_lse_matches_reference(shape, splits, torch_backend, paged_case):
    backend = TritonBackend(KernelConfig(num_splits=splits, block_n=16))
    seq_lens, query_lens = SHAPES[shape]
    case = paged_case(
        seq_lens=seq_lens, query_lens=query_lens, block_size=5, num_heads=4, num_kv_heads=2, head_dim=24, seed=splits
    )
    _check_lse(case, backend, torch_backend, scale=24**-0.5)
    _check_lse(case, backend, torch_backend, scale=24**-0.5, sliding_window=6)


@pytest.mark.parametrize("splits", [1, 2])
def test_lse_float64_and_a_row_that_sees_nothing(splits, torch_backend, paged_case):
    backend = TritonBackend(KernelConfig(num_splits=splits, block_n=16))
    case = paged_case(
        seq_lens=[40, 13], query_lens=[4, 13], block_size=8, num_heads=4, num_kv_heads=2, head_dim=24,
        dtype=torch.float64,
    )
    mask = torch.ones(case.meta.num_query_tokens, case.meta.max_seq_len, dtype=torch.bool)
    mask[5] = False
    lse = _check_lse(_with_meta(case, custom_mask=mask), backend, torch_backend, tol=FP64_TOL, scale=0.2)
    assert torch.isneginf(lse[5]).all() and torch.isfinite(lse[torch.arange(len(lse)) != 5]).all()


@pytest.mark.parametrize("splits", [1, 4])
def test_mla_lse_matches_reference(splits, torch_backend, mla_case):
    backend = TritonBackend(KernelConfig(num_splits=splits, block_n=16))
    case = mla_case(
        seq_lens=[60, 17, 5], query_lens=[4, 1, 5], block_size=16, num_heads=8, kv_lora_rank=32, rope_dim=16
    )
    _check_lse(case, backend, torch_backend, mla_rank=32, scale=0.1)


def test_lse_of_an_empty_batch(backend, paged_case):
    case = paged_case(seq_lens=[5], query_lens=[1], block_size=4, num_heads=2, num_kv_heads=1, head_dim=16)
    meta = AttentionMetadata.build(
        query_lens=[0],
        seq_lens=[5],
        block_tables=case.meta.block_tables,
        slot_mapping=case.meta.slot_mapping[:0],
        block_size=4,
    )
    out, lse = backend.attention(case.q[:0], case.k_cache, case.v_cache, meta, scale=1.0, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)
