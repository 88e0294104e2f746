"""fp8 KV pages: what a pool of ``--kv-cache-dtype fp8`` stores and how it is read back.

As vLLM keeps them: one scale per tensor (per layer and entry: K, V, an MLA latent, an indexer's keys),
a stored value being ``value / scale`` rounded to the fp8 type (clamped to its largest finite value
first, so an outlier saturates instead of becoming inf or NaN), read back as ``stored * scale`` in the
dtype attention runs in. The scale is 1.0 unless the checkpoint gives one (``k_scale`` / ``v_scale``).
"""

from __future__ import annotations

import torch

# ``kv_cache_dtype`` names -> storage dtype; "auto" is the model's own dtype.
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype pools store under ``kv_cache_dtype=name`` for a model computing in ``model_dtype``."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of {list(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(values: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``values / scale`` rounded to the fp8 ``dtype``, saturating at its largest finite value."""
    work = values if values.dtype == torch.float64 else values.float()
    if scale != 1.0:
        work = work / scale
    limit = torch.finfo(dtype).max
    return work.clamp(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored fp8 values back as ``dtype`` (exact: every fp8 value is a float32 / bfloat16 value), times
    ``scale``."""
    values = stored.to(dtype)
    return values if scale == 1.0 else values * scale


def round_trip(values: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What attention reads of ``values`` after they went through an fp8 ``dtype`` pool (the reference
    the tests compare fp8 pools with)."""
    return dequantize(quantize(values, scale, dtype), scale, values.dtype)
