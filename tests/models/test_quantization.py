"""Weight-only quantization (specdec.models.quantization): the rounding, torch's kernels against the
dequantized layer, which forwards take the kernels, and the shapes int4 refuses."""

from __future__ import annotations

import pytest
import torch

from specdec.backends import invariance
from specdec.models.layers import Linear
from specdec.models.quantization import GROUP_SIZE, MAX_KERNEL_ROWS, SCHEMES, quantize, quantize_weights


def _weight(out_features: int = 48, in_features: int = 64, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=generator) * 0.05).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_rounding_stays_within_half_a_step(scheme, dtype):
    weight = _weight(dtype=dtype)
    dequantized, _ = quantize(weight, scheme)
    assert dequantized.dtype == dtype and dequantized.shape == weight.shape
    if scheme == "int8":
        step = weight.abs().amax(dim=1, keepdim=True) / 127
        levels = (dequantized / step).round().unique()
        assert levels.numel() <= 255
    else:
        groups = weight.view(weight.shape[0], -1, GROUP_SIZE)
        step = ((groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15).repeat_interleave(GROUP_SIZE, -1)
        step = step.view_as(weight)
        per_group = dequantized.view(weight.shape[0], -1, GROUP_SIZE)
        assert max(len(g.unique()) for g in per_group.flatten(0, 1)) <= 16
    assert torch.all((dequantized - weight).abs() <= step / 2 * (1 + 1e-5))
    assert not torch.equal(dequantized, weight)  # it did round


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_kernels_compute_the_dequantized_layer(scheme, dtype):
    weight = _weight(dtype=dtype)
    dequantized, packed = quantize(weight, scheme)
    for rows in range(1, MAX_KERNEL_ROWS[scheme] + 1):
        x = torch.randn(rows, weight.shape[1]).to(dtype)
        assert packed.serves(x)
        got, want = packed(x).float(), (x.float() @ dequantized.float().T)
        assert got.shape == want.shape and got.dtype == torch.float32
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert (got - want).norm() <= tolerance * want.norm()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_linear_takes_the_kernel_only_where_it_serves(scheme):
    layer = Linear(64, 48, bias=True)
    with torch.no_grad():
        layer.weight.copy_(_weight())
        layer.bias.normal_()
    quantize_weights(layer, scheme)
    assert layer.quantized is not None and layer.prepacked is not None
    small = torch.randn(MAX_KERNEL_ROWS[scheme], 64)
    large = torch.randn(MAX_KERNEL_ROWS[scheme] + 1, 64)
    assert torch.equal(layer(small), layer.quantized(small) + layer.bias)
    assert not layer.quantized.serves(large) and not layer.quantized.serves(small.double())
    # Past the kernel's rows, and in the batch-invariant mode, the GEMM runs over the same (dequantized) values.
    assert torch.allclose(layer(large), large @ layer.weight.T + layer.bias, atol=1e-5)
    with invariance.batch_invariant(True):
        assert torch.allclose(layer(small), small @ layer.weight.T + layer.bias, atol=1e-5)
        assert not torch.equal(layer(small), layer.quantized(small) + layer.bias)


def test_int4_takes_whole_groups_of_inputs():
    with pytest.raises(ValueError, match=r"int4 quantization groups 32 inputs, and layer '0' takes 48: use quantization='int8'"):
        quantize_weights(torch.nn.Sequential(Linear(48, 32)), "int4")
    quantize_weights(torch.nn.Sequential(Linear(48, 32)), "int8")  # int8 takes any width


def test_int4_output_widths_the_packing_refuses_run_on_the_gemm():
    dequantized, packed = quantize(_weight(out_features=40), "int4")  # 40 rows: not a multiple of 16
    assert packed is None and dequantized.shape == (40, 64)


def test_unknown_scheme_names_the_choices():
    with pytest.raises(ValueError, match="unknown weight quantization 'fp8'; choose one of int8, int4"):
        quantize(_weight(), "fp8")
