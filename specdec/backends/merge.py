"""Combining attention computed separately over disjoint key sets (for example two KV pools).

Attention over keys ``A ∪ B`` is the LSE-weighted mean of attention over ``A`` and over ``B``:
``out = (exp(lse_a - m) out_a + exp(lse_b - m) out_b) / (exp(lse_a - m) + exp(lse_b - m))`` with
``m = max(lse_a, lse_b)``, and ``lse = m + log(exp(lse_a - m) + exp(lse_b - m))``. Backends return the
``(out, lse)`` pairs with ``return_lse=True``.
"""

from __future__ import annotations

import torch


def merge_attention_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over both key sets from the partial results over each.

    ``out_*`` are ``[T, H, D]`` (any float dtype, both the same), ``lse_*`` are ``[T, H]``. A side whose
    ``lse`` is ``-inf`` saw no key and contributes nothing, whatever its ``out`` holds (even NaN); a
    row that neither side saw comes out as zeros with ``lse -inf``. The arithmetic runs in the wider of
    float32 and the inputs' dtypes, so float64 inputs merge exactly (to rounding). Returns ``out`` in
    ``out_a``'s dtype, or ``(out, lse)`` with ``return_lse`` (to merge a third source in).
    """
    _check_shapes(out_a, lse_a, out_b, lse_b)
    compute = torch.promote_types(torch.promote_types(out_a.dtype, lse_a.dtype), torch.float32)
    lse_a = lse_a.to(compute)
    lse_b = lse_b.to(compute)
    m = torch.maximum(lse_a, lse_b)
    # Both sides empty: shift by 0 so the weights are exp(-inf) = 0, not exp(nan).
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_a = torch.exp(lse_a - m)
    w_b = torch.exp(lse_b - m)
    total = w_a + w_b
    seen = total > 0
    inv = torch.where(seen, 1.0 / torch.where(seen, total, torch.ones_like(total)), torch.zeros_like(total))
    # where(), not multiplication: 0 * NaN is NaN, and an empty side's output is not promised finite.
    part_a = torch.where((w_a > 0)[..., None], out_a.to(compute) * (w_a * inv)[..., None], 0.0)
    part_b = torch.where((w_b > 0)[..., None], out_b.to(compute) * (w_b * inv)[..., None], 0.0)
    out = (part_a + part_b).to(out_a.dtype)
    if not return_lse:
        return out
    lse = torch.where(seen, m + torch.log(torch.where(seen, total, torch.ones_like(total))), float("-inf"))
    return out, lse


def _check_shapes(out_a, lse_a, out_b, lse_b) -> None:
    if out_a.dim() != 3 or out_a.shape != out_b.shape:
        raise ValueError(
            f"merge_attention_states: outputs must both be [T, H, D], got {tuple(out_a.shape)} and {tuple(out_b.shape)}"
        )
    if out_a.dtype != out_b.dtype:
        raise ValueError(f"merge_attention_states: outputs differ in dtype ({out_a.dtype} vs {out_b.dtype}); cast one")
    expected = tuple(out_a.shape[:2])
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(lse.shape) != expected:
            raise ValueError(
                f"merge_attention_states: {name} must be [T, H] = {list(expected)} to match the outputs, "
                f"got {tuple(lse.shape)} (pass return_lse=True to the backend)"
            )
        if not lse.is_floating_point():
            raise ValueError(f"merge_attention_states: {name} must be a float tensor, got {lse.dtype}")
