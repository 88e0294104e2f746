"""Host-side launchers of the Triton kernels: shape checks, tile choices, grids."""

from __future__ import annotations

import functools
from typing import Mapping

import torch
import triton
import triton.language as tl

from specdec.backends import invariance
from specdec.backends.base import AttentionMetadata, lse_dtype
from specdec.backends.triton import kernels
from specdec.backends.triton.config import KernelConfig
from specdec.backends.triton.runtime import check_device

_MAX_SPLITS = 16


def _pad(width: int) -> int:
    # tl.arange needs powers of two and tl.dot needs >= 16 on every axis.
    return max(16, triton.next_power_of_2(max(width, 1)))


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_scale_cache: dict[tuple[float, torch.dtype, str], torch.Tensor] = {}


def _scale_tensor(scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # A tensor, not a kernel float argument: Triton passes Python floats as fp32, which would
    # round the scale of a float64 model.
    key = (float(scale), dtype, str(device))
    tensor = _scale_cache.get(key)
    if tensor is None:
        tensor = _scale_cache[key] = torch.tensor([scale], dtype=dtype, device=device)
    return tensor


# ----------------------------------------------------------------------------- KV writes


def write_slots(
    layer: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor], slot_mapping: torch.Tensor
) -> None:
    """Store each ``values[entry]`` row at its slot of ``layer[entry]``; negative slots are skipped."""
    items = list(values.items())
    if not items:
        return
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    slots = slot_mapping.reshape(-1)
    pairs = []
    for key, value in items:
        if key not in layer:
            raise KeyError(f"write_kv: the layer has no entry {key!r}; it has {sorted(layer)}")
        cache = layer[key]
        check_device(cache)
        width = cache[0, 0].numel()
        try:
            flat = cache.view(cache.shape[0] * cache.shape[1], width)
        except RuntimeError:
            raise ValueError(f"write_kv: cache entry {key!r} must be contiguous per token (a pool tensor)") from None
        if value.shape[0] != num_tokens or value[0].numel() != width:
            raise ValueError(
                f"write_kv: values[{key!r}] has shape {tuple(value.shape)}, expected [{num_tokens}, "
                f"{', '.join(map(str, cache.shape[2:]))}] to match slot_mapping and the cache"
            )
        # Cast on the host: torch rounds to nearest like the reference (the interpreter's bf16 cast truncates).
        src = value.reshape(num_tokens, width).to(cache.dtype)
        if src.stride(-1) != 1:
            src = src.contiguous()
        pairs.append((src, flat))
    slots = slots.to(device=pairs[0][1].device, dtype=torch.int64)
    for i in range(0, len(pairs), 2):
        (src0, dst0), second = pairs[i], pairs[i + 1] if i + 1 < len(pairs) else None
        src1, dst1 = second if second is not None else (src0, dst0)
        widest = max(dst0.shape[1], dst1.shape[1])
        block = min(1024, triton.next_power_of_2(widest))
        grid = (num_tokens, triton.cdiv(widest, block))
        kernels.write_slots_kernel[grid](
            src0,
            dst0,
            src1,
            dst1,
            slots,
            src0.stride(0),
            dst0.stride(0),
            src1.stride(0),
            dst1.stride(0),
            WIDTH0=dst0.shape[1],
            WIDTH1=dst1.shape[1],
            HAS_SECOND=second is not None,
            BLOCK=block,
        )


# ----------------------------------------------------------------------------- attention


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    meta: AttentionMetadata,
    *,
    scale: float,
    v_dim: int | None = None,
    sliding_window: int | None = None,
    config: KernelConfig | None = None,
    return_lse: bool = False,
    kv_scales: tuple[float, float] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen paged attention; ``v_cache=None`` means MLA (values = first ``v_dim`` key columns).
    ``kv_scales``: (keys', values') scales of fp8 pages (MLA: the latent's, twice).

    ``q [T, H, D]``, ``k_cache [blocks, page, kv_heads, D]``, ``v_cache [blocks, page, kv_heads, DV]``.
    Returns ``[T, H, DV]`` in ``q``'s dtype, and with ``return_lse`` also ``lse [T, H]`` (see
    :meth:`specdec.backends.base.AttentionBackend.attention`).
    """
    config = config or KernelConfig()
    check_device(q)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads, k_dim = k_cache.shape
    shared = v_cache is None
    if k_dim != head_dim:
        raise ValueError(f"attention: query head_dim {head_dim} differs from the cache's key width {k_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"attention: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if page != meta.block_size:
        raise ValueError(f"attention: cache page size {page} differs from meta.block_size {meta.block_size}")
    if shared:
        if v_dim is None or not 0 < v_dim < head_dim:
            raise ValueError(f"mla_attention: kv_lora_rank must be in (0, {head_dim}), got {v_dim}")
        v_cache = k_cache
    else:
        if v_cache.shape[:3] != k_cache.shape[:3]:
            raise ValueError(
                f"attention: k cache {tuple(k_cache.shape)} and v cache {tuple(v_cache.shape)} disagree on pages/heads"
            )
        v_dim = v_cache.shape[3]
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"attention: sliding_window must be >= 1 (or None), got {sliding_window}")
    out = torch.empty((num_tokens, num_heads, v_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((num_tokens, num_heads), dtype=lse_dtype(q.dtype), device=q.device) if return_lse else None
    if num_tokens == 0:
        return (out, lse) if return_lse else out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attention: KV caches must be contiguous in head_dim (pool tensors are)")

    device = q.device
    block_tables = meta.block_tables.to(device=device, dtype=torch.int32)
    seq_lens = meta.seq_lens.to(device=device, dtype=torch.int32)
    query_start = meta.query_start_loc.to(device=device, dtype=torch.int32)
    mask = meta.custom_mask
    if mask is not None:
        if mask.shape[0] != num_tokens or mask.shape[1] < meta.max_seq_len:
            raise ValueError(
                f"attention: custom_mask must be [num_tokens={num_tokens}, >= max_seq_len={meta.max_seq_len}], "
                f"got {tuple(mask.shape)}"
            )
        mask = mask.to(device=device, dtype=torch.uint8)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()

    group = num_heads // num_kv_heads
    d_pad = _pad(head_dim)
    dv_pad = _pad(v_dim)
    r_pad = _pad(head_dim - v_dim) if shared else 16
    width = dv_pad + (r_pad if shared else d_pad)
    # Large heads (the 576-wide MLA latent) need smaller tiles to stay in registers.
    auto_m = 64 if width <= 256 else 32 if width <= 640 else 16
    # The batch-invariant mode keeps one tile shape and one key split whatever the batch: a row's products
    # and its keys' blocks (from position 0) are then the same alone and beside any other rows.
    invariant = invariance.enabled()
    block_m = config.block_m or (auto_m if invariant else min(auto_m, _pad(meta.max_query_len * group)))
    block_n = config.block_n or (64 if width <= 256 else 32)
    row_blocks = triton.cdiv(meta.max_query_len * group, block_m)
    num_requests = meta.num_requests
    num_splits = 1 if invariant else config.num_splits or _auto_splits(device, num_requests * row_blocks * num_kv_heads, meta.max_seq_len, block_n)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32

    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, dv_pad), dtype=acc_dtype, device=device)
        part_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=acc_dtype, device=device)
    else:
        part_acc = part_ml = out  # never touched
    launch = {}
    num_warps = config.num_warps or (4 if width <= 256 else 8)
    if not kernels.INTERPRETED:
        launch["num_warps"] = num_warps
        if config.num_stages is not None:
            launch["num_stages"] = config.num_stages

    grid = (num_requests * row_blocks, num_kv_heads, num_splits)
    kernels.paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        lse if return_lse else out,
        part_acc,
        part_ml,
        block_tables,
        seq_lens,
        query_start,
        mask if mask is not None else seq_lens,
        _scale_tensor(scale, acc_dtype, device),
        torch.tensor(kv_scales or (1.0, 1.0), dtype=acc_dtype, device=device),
        int(sliding_window or 0),
        row_blocks,
        num_heads,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        mask.stride(0) if mask is not None else 0,
        GROUP=group,
        PAGE=page,
        HEAD_DIM=head_dim,
        V_DIM=v_dim,
        D_PAD=d_pad,
        DV_PAD=dv_pad,
        R_PAD=r_pad,
        SHARED_KV=shared,
        CAUSAL=bool(meta.causal),
        HAS_WINDOW=sliding_window is not None,
        HAS_MASK=mask is not None,
        HAS_LSE=return_lse,
        NUM_SPLITS=num_splits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        ACC=tl.float64 if acc_dtype == torch.float64 else tl.float32,
        UPCAST=kernels.INTERPRETED and q.dtype == torch.bfloat16,
        KV_SCALED=kv_scales is not None,
        **launch,
    )
    if num_splits > 1:
        kernels.split_reduce_kernel[(num_tokens, num_heads)](
            out,
            lse if return_lse else out,
            part_acc,
            part_ml,
            num_heads,
            out.stride(0),
            out.stride(1),
            V_DIM=v_dim,
            DV_PAD=dv_pad,
            NUM_SPLITS=num_splits,
            HAS_LSE=return_lse,
        )
    return (out, lse) if return_lse else out


def _auto_splits(device: torch.device, programs: int, max_seq_len: int, block_n: int) -> int:
    """Split the keys only when the grid alone would leave most of the GPU idle."""
    if kernels.INTERPRETED or device.type != "cuda":
        return 1
    target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= target:
        return 1
    # Each split should still stream a few tiles, or the reduction costs more than it saves.
    by_length = max_seq_len // (4 * block_n)
    splits = min(_MAX_SPLITS, triton.cdiv(target, programs), max(by_length, 1))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two (tl.arange in the reduce)
