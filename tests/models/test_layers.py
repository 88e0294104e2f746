"""The shared building blocks against their written-out formulas."""

import pytest
import torch
from transformers import LlamaConfig

from specdec.backends.base import math_dtype
from specdec.models.layers import PackedLinear, RMSNorm, RotaryEmbedding
from specdec.models.loader import CheckpointError
from specdec.models.weights import load_named_weights


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rms_norm_is_the_float32_formula_rounded_once(dtype, unit_offset):
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, eps=1e-5, unit_offset=unit_offset)
    norm.weight.data = torch.randn(96, generator=gen) * 0.3 + (0.0 if unit_offset else 1.0)
    norm.to(dtype)
    x = (torch.randn(7, 96, generator=gen) * 4).to(dtype)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    h = x.to(work)
    weight = norm.weight.to(work) + (1.0 if unit_offset else 0.0)
    expected = (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))).to(dtype)
    got = norm(x)
    norm.requires_grad_(False).prepack_weights()  # served weights (no grad) read the prepared 1 + weight
    assert torch.equal(norm(x), got) and (norm.prepared is not None) == unit_offset
    norm.double()
    assert norm.prepared is None  # cast: the prepared copy no longer matches
    assert got.dtype == dtype
    if dtype == torch.float64:
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)
    else:
        # One rounding to dtype at the end: at most one unit in the last place apart.
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6,
                                   atol=1e-6)


def _config(rotary: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=rotary,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_table_rotates_like_the_pairwise_formula_at_any_position(interleaved):
    """Positions past the first table (4096 rows) grow it; partial RoPE leaves the tail alone."""
    head_dim, rotary_dim = 16, 8
    rope = RotaryEmbedding(_config(head_dim), rotary_dim, interleaved=interleaved)
    positions = torch.tensor([0, 5, 4095, 4096, 70000])
    x = torch.randn(5, 3, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (got,) = rope(positions, x)
    angles = positions.float()[:, None] * rope.inv_freq[None, :]
    cos, sin = angles.cos().double()[:, None, :], angles.sin().double()[:, None, :]
    rot = x[..., :rotary_dim]
    if interleaved:
        first, second = rot[..., 0::2], rot[..., 1::2]
    else:
        first, second = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
    new_first, new_second = first * cos - second * sin, second * cos + first * sin
    expected = x.clone()
    if interleaved:
        expected[..., 0:rotary_dim:2], expected[..., 1:rotary_dim:2] = new_first, new_second
    else:
        expected[..., : rotary_dim // 2], expected[..., rotary_dim // 2 : rotary_dim] = new_first, new_second
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])


class _TwoProjections(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.qkv_proj = PackedLinear(8, {"q_proj": 6, "k_proj": 2, "v_proj": 2}, bias=True)


def test_packed_linear_loads_its_parts_and_computes_them_in_one_product():
    gen = torch.Generator().manual_seed(3)
    parts = {f"attn.{p}.{s}": torch.randn(rows, *((8,) if s == "weight" else ()), dtype=torch.float64, generator=gen)
             for p, rows in (("q_proj", 6), ("k_proj", 2), ("v_proj", 2)) for s in ("weight", "bias")}
    module = _TwoProjections().double()
    load_named_weights(module, parts.items())
    x = torch.randn(3, 8, dtype=torch.float64, generator=gen)
    packed = module.attn.qkv_proj
    for part, got in zip(("q_proj", "k_proj", "v_proj"), packed.split(packed(x))):
        expected = x @ parts[f"attn.{part}.weight"].T + parts[f"attn.{part}.bias"]
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)
    parts.pop("attn.k_proj.bias")
    with pytest.raises(CheckpointError, match=r"qkv_proj\.bias \(2 of 3 pieces\): attn\.k_proj\.bias"):
        load_named_weights(_TwoProjections().double(), parts.items())


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_models_serve_from_prepacked_weights_and_casts_drop_them(tiny_checkpoint, dtype):
    """load_model prepacks every Linear and the LM head on the CPU in float32 and bfloat16 (a bf16 weight
    as a float32 copy where oneDNN has no bf16 GEMMs); the products agree with plain F.linear to
    rounding, and a cast to float64 runs unpacked, exactly."""
    from specdec.models.layers import Linear
    from specdec.models.loader import load_model

    model = load_model(tiny_checkpoint("llama"), dtype=dtype)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    served = math_dtype(dtype, torch.device("cpu"))  # float32 for bf16 on an AVX2-only CPU
    assert linears and all(m.prepacked is not None and m.prepacked.dtype == served for m in linears)
    assert model._prepacked_head is not None and model._prepacked_head.dtype == served
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    x = torch.randn(4, model.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    for m in linears:
        inp = torch.randn(3, m.in_features, generator=torch.Generator().manual_seed(m.in_features)).to(dtype)
        torch.testing.assert_close(m(inp), torch.nn.functional.linear(inp, m.weight, m.bias), **tol)
    head = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
    torch.testing.assert_close(model.compute_logits(x), x @ head.T, **tol)
    # Weights that need gradients (fine-tuning a loaded model) go through autograd's F.linear.
    probe = linears[0]
    probe.weight.requires_grad_(True)
    probe(torch.randn(2, probe.in_features).to(dtype)).sum().backward()
    assert probe.weight.grad is not None and probe.weight.grad.abs().sum() > 0
    model.double()
    assert all(m.prepacked is None for m in linears) and model._prepacked_head is None
    assert torch.equal(model.compute_logits(x.double()), torch.nn.functional.linear(x.double(), head.double()))


@pytest.mark.skipif(math_dtype(torch.bfloat16, torch.device("cpu")) != torch.float32,
                    reason="oneDNN has bf16 kernels on this CPU: bf16 weights serve as they are")
def test_a_bf16_mla_moe_model_serves_its_einsums_and_experts_from_float32_copies(tiny_checkpoint):
    """Where the CPU has no bf16 kernels, load_model gives MLA's absorbed maps and the MoE experts float32
    copies of their bf16 weights (beside every Linear's); a cast drops them."""
    from specdec.models.deepseek_v3 import DeepseekV3Attention
    from specdec.models.loader import load_model
    from specdec.models.moe import FusedExperts

    model = load_model(tiny_checkpoint("deepseek_v3"), dtype=torch.bfloat16)
    attention = [m for m in model.modules() if isinstance(m, DeepseekV3Attention)]
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert attention and experts
    for m in attention:
        for copy, weight in zip(m.absorbed, m.absorbed_maps(m.kv_b_proj.weight)):
            assert copy.dtype == torch.float32 and torch.equal(copy, weight.float())
    assert all(m.prepacked is not None for m in experts)
    model.double()
    assert all(m.absorbed is None for m in attention) and all(m.prepacked is None for m in experts)
