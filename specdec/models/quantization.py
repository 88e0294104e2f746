"""Weight-only quantization of a served model's linear layers (the speculative config's ``quantization``).

A draft only proposes: the target verifies every token, so a draft whose weights are rounded to fewer
bits changes which tokens it proposes (its acceptance), never what the engine emits. A draft step
runs a few rows through every weight, so on a CPU it costs the weights' bytes more than their
arithmetic: the zoo MiniMax-M3 EAGLE3 draft's layers (bf16, 1 thread, read from memory) took 589 us
for one row, 406 us from int8 and 251 us from int4 weights (``benchmarks/bench_quantized_linear.py``);
at concurrency 1 and k=5 the engine served 2.30x plain decoding's tokens per second with the int4
draft, 2.18x with the bf16 one, at an acceptance within 2% of it (``benchmarks/bench_adaptive.py``).

Schemes (:data:`SCHEMES`):

- ``"int8"``: per output row, symmetric: ``w ~ scale * q``, ``q`` in -127..127.
- ``"int4"``: per output row and group of :data:`GROUP_SIZE` consecutive inputs, asymmetric:
  ``w ~ low + scale * q``, ``q`` in 0..15. Every layer's input width must be a multiple of the group.

The model's weights *become* the quantized values (dequantized, in its dtype), so whatever runs a
layer computes the same model: the usual GEMM over those values, or, for a forward of at most
``MAX_KERNEL_ROWS[scheme]`` rows on the CPU in a half or single dtype, torch's weight-only kernels over
the packed integers (a quarter or half of the bytes). Past those rows the kernels cost more than the
bf16 GEMM, whose arithmetic they do row by row. The batch-invariant mode never takes the kernels (its
row blocks keep one path whatever the batch), nor does float64, for which torch has none.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.layers import Linear, PrepackedLMHead, prepack_weights

SCHEMES = ("int8", "int4")
GROUP_SIZE = 32
# Rows up to which a forward takes the packed kernel (benchmarks/bench_quantized_linear.py: int4 costs
# what the bf16 GEMM does at about 8 rows, int8 at about 3).
MAX_KERNEL_ROWS = {"int8": 2, "int4": 4}
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT4_ROWS_MULTIPLE = 16  # torch's int4 packing takes output widths in multiples of 16


class PackedWeight:
    """A layer's quantized weight as torch's weight-only kernels take it; called on ``x [..., in]``."""

    def __init__(self, scheme: str, packed: torch.Tensor, scales: torch.Tensor):
        self.scheme = scheme
        self.packed = packed  # int8 [out, in], or int4 packed by _convert_weight_to_int4pack_for_cpu
        self.scales = scales  # int8: [out]; int4: [in / GROUP_SIZE, out, 2] (scale, zero), float32
        self.max_rows = MAX_KERNEL_ROWS[scheme]
        self._scales_as: dict[torch.dtype, torch.Tensor] = {}  # the kernels take scales in x's dtype

    def serves(self, x: torch.Tensor) -> bool:
        """Whether the kernel runs ``x`` (else the GEMM over the dequantized weight does). ``x`` is on
        the CPU: a packed copy exists only for a CPU weight (:func:`quantize`)."""
        return x.dtype in _KERNEL_DTYPES and x.numel() <= self.max_rows * x.shape[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        scales = self._scales_as.get(x.dtype)
        if scales is None:
            scales = self._scales_as[x.dtype] = self.scales.to(x.dtype)
        if self.scheme == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows, self.packed, scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, scales)
        return y.view(*x.shape[:-1], y.shape[-1])


def quantize(weight: torch.Tensor, scheme: str, where: str = "a layer") -> tuple[torch.Tensor, PackedWeight | None]:
    """``weight [out, in]`` rounded by ``scheme``: the dequantized values in its dtype, and the packed
    copy the kernels take (None off the CPU, or where torch's packing does not take the shape)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown weight quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    out_features, in_features = weight.shape
    work = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.detach().to(work)
    kernel = weight.device.type == "cpu"  # torch's packed weight-only kernels are CPU ones
    packed = None
    if scheme == "int8":
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127)
        dequantized = q * scale[:, None]
        if kernel:
            packed = PackedWeight(scheme, q.to(torch.int8), scale.float())
    else:
        if in_features % GROUP_SIZE:
            raise ValueError(
                f"int4 quantization groups {GROUP_SIZE} inputs, and {where} takes {in_features}: "
                "use quantization='int8' for this draft"
            )
        groups = w.view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low = groups.amin(dim=-1, keepdim=True)
        scale = ((groups.amax(dim=-1, keepdim=True) - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((groups - low) / scale).clamp(0, 15)
        dequantized = (q * scale + low).view(out_features, in_features)
        if kernel and out_features % _INT4_ROWS_MULTIPLE == 0:
            # The kernel computes (q - 8) * scale + zero: its zero is the group's value at q = 8.
            scales = torch.cat([scale, low + 8 * scale], dim=-1).transpose(0, 1).float().contiguous()
            codes = q.view(out_features, in_features).to(torch.int32)
            packed = PackedWeight(scheme, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2), scales)
    return dequantized.to(weight.dtype), packed


def quantize_weights(model: nn.Module, scheme: str) -> None:
    """Quantize every :class:`~specdec.models.layers.Linear` of a loaded ``model`` and the rows its
    logits read (:class:`~specdec.models.layers.PrepackedLMHead`) by ``scheme``, then prepack again
    (:func:`~specdec.models.layers.prepack_weights`: the serving copies, and whatever a layer derives
    from its weights, follow the new values). The logits' rows are quantized as a copy: they may be
    the model's embedding (tied) or another model's head (an EAGLE3 draft reading the target's)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            dequantized, packed = quantize(module.weight, scheme, where=f"layer {name!r}")
            with torch.no_grad():
                module.weight.copy_(dequantized)
            module.quantized = packed
        if isinstance(module, PrepackedLMHead):
            module.quantize_head(*quantize(module.output_weight(), scheme, where=f"the LM head of {name or 'the model'!r}"))
    prepack_weights(model)
