"""AMD aiter's own kernels, loaded without ROCm, against the torch reference (interpreter on a CPU).

Stale slots of a page are poisoned with a large finite value, not NaN: aiter's decode tile spans a
whole page and multiplies the (zero) probabilities of the unused tail by whatever is stored there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import attrs
import pytest
import torch

from specdec.backends import aiter_loader, get_backend

POISON = 1.0e4
FP32_TOL = dict(atol=1e-5, rtol=1e-5)

SHAPES = {
    "decode": ([37, 5, 20], [1, 1, 1]),
    "verify": ([23, 4, 41], [4, 4, 4]),
    "prefill": ([9, 17], [9, 17]),
    "mixed": ([30, 12, 7], [6, 1, 7]),
}


@pytest.fixture(scope="module")
def backend():
    return get_backend("aiter")


def _check(case, backend, torch_backend, **kwargs):
    ref = torch_backend.attention(case.q, case.clean_k, case.clean_v, case.meta, **kwargs)
    out = backend.attention(case.q, case.k_cache, case.v_cache, case.meta, **kwargs)
    assert out.shape == ref.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(out, ref, **FP32_TOL)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(4, 4, 16, 16), (4, 2, 48, 32), (8, 2, 80, 16)],
    ids=["mha-d16-p16", "gqa2-d48-p32", "gqa4-d80-p16"],
)
def test_unified_attention_matches_reference(shape, heads, kv_heads, head_dim, block_size, backend, torch_backend, paged_case):
    seq_lens, query_lens = SHAPES[shape]
    case = paged_case(
        seq_lens=seq_lens,
        query_lens=query_lens,
        block_size=block_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        poison=POISON,
        seed=len(shape) + head_dim,
    )
    _check(case, backend, torch_backend, scale=head_dim**-0.5)


@pytest.mark.parametrize("window", [1, 6])
def test_sliding_window(window, backend, torch_backend, paged_case):
    case = paged_case(
        seq_lens=[45, 9, 30], query_lens=[4, 9, 1], block_size=16, num_heads=4, num_kv_heads=2, head_dim=16, poison=POISON
    )
    _check(case, backend, torch_backend, scale=0.25, sliding_window=window)


def test_long_context_takes_the_segmented_kernel(backend, torch_backend, paged_case):
    # Past 512 keys with few programs, unified_attention splits the keys (its "3d" kernel + reduce).
    case = paged_case(seq_lens=[530], query_lens=[2], block_size=16, num_heads=2, num_kv_heads=1, head_dim=16, poison=POISON)
    _check(case, backend, torch_backend, scale=0.25)


# ----------------------------------------------------------------------------- MLA


@pytest.mark.parametrize(
    "shape,heads,rank,rope,block_size",
    [
        ("decode", 8, 32, 16, 16),
        ("verify", 8, 32, 16, 16),
        ("mixed", 8, 32, 16, 16),
        ("decode", 16, 48, 16, 1),
        ("verify", 16, 48, 16, 1),
        ("mixed", 20, 32, 16, 6),
    ],
)
def test_mla_decode_matches_reference(shape, heads, rank, rope, block_size, backend, torch_backend, mla_case):
    seq_lens, query_lens = SHAPES[shape]
    case = mla_case(
        seq_lens=seq_lens,
        query_lens=query_lens,
        block_size=block_size,
        num_heads=heads,
        kv_lora_rank=rank,
        rope_dim=rope,
        poison=POISON,
    )
    ref = torch_backend.mla_attention(case.q, case.clean_k, case.meta, kv_lora_rank=rank, scale=0.1)
    out = backend.mla_attention(case.q, case.k_cache, case.meta, kv_lora_rank=rank, scale=0.1)
    assert out.shape == (case.meta.num_query_tokens, heads, rank)
    torch.testing.assert_close(out, ref, **FP32_TOL)


@pytest.mark.parametrize("block_size", [16, 5])
def test_mla_prefill(block_size, torch_backend, mla_case):
    # 16-token pages: long query runs go through unified_attention with the latent as K and V;
    # 5-token pages cannot, and fall to the per-token decode rows. Both must be exact.
    backend = get_backend("aiter")
    backend.mla_decode_max_queries = 4
    case = mla_case(
        seq_lens=[30, 21], query_lens=[30, 8], block_size=block_size, num_heads=4, kv_lora_rank=32, rope_dim=16, poison=POISON
    )
    ref = torch_backend.mla_attention(case.q, case.clean_k, case.meta, kv_lora_rank=32, scale=0.12)
    out = backend.mla_attention(case.q, case.k_cache, case.meta, kv_lora_rank=32, scale=0.12)
    torch.testing.assert_close(out, ref, **FP32_TOL)


# ----------------------------------------------------------------------------- surface


def test_write_kv_scatters_into_pages(backend, torch_backend):
    g = torch.Generator().manual_seed(0)
    layer = {"k": torch.randn(6, 16, 2, 8, generator=g), "v": torch.randn(6, 16, 2, 8, generator=g)}
    expected = {key: tensor.clone() for key, tensor in layer.items()}
    values = {"k": torch.randn(5, 2, 8, generator=g), "v": torch.randn(5, 2, 8, generator=g)}
    slots = torch.tensor([3, 40, 17, 95, 64])
    backend.write_kv(layer, values, slots)
    torch_backend.write_kv(expected, values, slots)
    for key in layer:
        assert torch.equal(layer[key], expected[key])


def test_page_sizes(backend):
    assert [s for s in (1, 8, 16, 24, 32, 48, 64, 128) if backend.supports_block_size(s, "attention")] == [16, 32, 64, 128]
    assert all(backend.supports_block_size(s, "mla") for s in (1, 5, 16, 64))
    assert not backend.supports_block_size(16, "linear")


def test_loaded_without_running_aiters_init(backend):
    if aiter_loader.is_rocm():
        pytest.skip("on ROCm the real package is imported")
    assert backend.mode in ("triton-interpreter", "triton-gpu")
    stub = sys.modules["aiter"]
    assert getattr(stub, "__specdec_stub__", False)
    assert not hasattr(stub, "mla_decode_fwd")  # the package's __init__ never ran


def test_unsupported_inputs_fail_clearly(backend, paged_case):
    case = paged_case(seq_lens=[20], query_lens=[3], block_size=16, num_heads=2, num_kv_heads=1, head_dim=16)
    tree = attrs.evolve(case.meta, custom_mask=torch.ones(3, 20, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="causal-only"):
        backend.attention(case.q, case.k_cache, case.v_cache, tree, scale=1.0)
    with pytest.raises(TypeError, match="float64"):
        backend.attention(case.q.double(), case.k_cache.double(), case.v_cache.double(), case.meta, scale=1.0)
    with pytest.raises(ValueError, match="equal query, key and value head sizes"):
        backend.attention(case.q, case.k_cache, case.v_cache[..., :8], case.meta, scale=1.0)
    small = paged_case(seq_lens=[9], query_lens=[1], block_size=8, num_heads=2, num_kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="multiple of 16"):
        backend.attention(small.q, small.k_cache, small.v_cache, small.meta, scale=1.0)


def test_missing_package_names_the_extra(monkeypatch):
    # sys.modules[name] = None is how Python marks a module as not importable.
    monkeypatch.setitem(sys.modules, "aiter", None)
    aiter_loader.load.cache_clear()
    try:
        with pytest.raises(ImportError) as info:
            get_backend("aiter")
    finally:
        monkeypatch.undo()
        aiter_loader.load.cache_clear()
    message = str(info.value)
    assert "pip install specdec[rocm]" in message and "\n" not in message


def test_without_gpu_or_interpreter_says_how_to_fix():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from specdec.backends import get_backend; get_backend('aiter')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "AiterUnavailableError" in last and "TRITON_INTERPRET=1" in last
