"""FusedExperts: both schedules (every expert on few tokens, routed rows otherwise) give the MoE sum."""

import pytest
import torch

from specdec.backends.base import math_dtype
from specdec.models.moe import FusedExperts, sigmoid_topk_routing


def make_experts(num_experts: int, hidden: int = 16, inter: int = 8, top_k: int = 2) -> FusedExperts:
    torch.manual_seed(0)
    experts = FusedExperts(num_experts, hidden, inter, lambda gu: torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:],
                           top_k=top_k)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn_like(experts.gate_up_proj) / hidden**0.5)
        experts.down_proj.copy_(torch.randn_like(experts.down_proj) / inter**0.5)
    return experts.double()


def naive(experts: FusedExperts, x, chosen, weights) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(chosen.shape[1]):
            e = int(chosen[t, slot])
            h = experts.activation(experts.gate_up_proj[e] @ x[t])
            out[t] += weights[t, slot] * (experts.down_proj[e] @ h)
    return out


@pytest.mark.parametrize("served", [False, True])  # served: the dense schedule runs as two wide layers
@pytest.mark.parametrize("num_experts,num_tokens", [(4, 1), (4, 4), (4, 16), (4, 17), (4, 300), (8, 3), (64, 1), (64, 5)])
def test_matches_the_per_token_sum(num_experts, num_tokens, served):
    experts = make_experts(num_experts)
    if served:
        experts.prepack_weights()
        assert (experts.wide is not None) == (num_experts == 4 or num_experts == 8)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 16, dtype=torch.float64, generator=gen)
    logits = torch.randn(num_tokens, num_experts, dtype=torch.float64, generator=gen)
    weights, chosen = sigmoid_topk_routing(logits, torch.zeros(num_experts, dtype=torch.float64), 2)
    with torch.inference_mode():
        got = experts(x, chosen, weights)
    torch.testing.assert_close(got, naive(experts, x, chosen, weights), rtol=1e-12, atol=1e-12)


def test_the_schedules_agree_and_the_threshold_picks_them():
    experts = make_experts(4)
    x = torch.randn(6, 16, dtype=torch.float64)
    chosen = torch.tensor([[0, 1], [1, 0], [2, 3], [3, 3], [0, 2], [1, 1]])  # a token may route twice to one
    weights = torch.rand(6, 2, dtype=torch.float64)
    every = experts._every_expert(x, chosen)
    torch.testing.assert_close(every, experts._routed_rows(x, chosen), rtol=1e-12, atol=1e-12)
    experts.prepack_weights()
    torch.testing.assert_close(experts._dense(x, chosen, weights), experts._weighted_sum(every, weights),
                               rtol=1e-12, atol=1e-12)
    most = FusedExperts.DENSE_MAX_ROWS_PER_EXPERT * 4 // 2  # tokens routing 32 rows to each of 4 experts
    assert experts.runs_dense(6) and experts.runs_dense(most)  # these batches run dense ...
    assert not experts.runs_dense(most + 1)  # ... a longer prompt does not ...
    assert not make_experts(256, top_k=8).runs_dense(1)  # ... and a 256-expert MoE never does, even for one token


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_served_wide_layers_match_the_per_token_sum(dtype, tolerance):
    """Served, the dense schedule runs from prepacked copies of the two wide layers (oneDNN's, or a
    float32 copy where the CPU has no half GEMMs), and agrees with the float64 sum to the dtype's rounding;
    a cast drops them."""
    reference = make_experts(4)
    experts = make_experts(4).to(dtype)
    experts.prepack_weights()
    assert experts.wide is not None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, dtype=torch.float64, generator=gen)
    weights, chosen = sigmoid_topk_routing(torch.randn(5, 4, generator=gen), torch.zeros(4), 2)
    with torch.inference_mode():
        got = experts(x.to(dtype), chosen, weights)
    assert got.dtype == torch.float32  # summed in at least float32, as the batched schedule's
    want = naive(reference, x.to(dtype).double(), chosen, weights.double())
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    experts.double()
    assert experts.wide is None


@pytest.mark.skipif(math_dtype(torch.bfloat16, torch.device("cpu")) != torch.float32,
                    reason="oneDNN has bf16 kernels on this CPU: bf16 experts run in bf16")
@pytest.mark.parametrize("num_tokens", [3, 17])  # the dense schedule, the routed one
def test_half_experts_without_half_kernels_serve_from_float32_copies(num_tokens):
    """prepack_weights keeps float32 copies of bf16 experts where the CPU has no bf16 kernels; both
    schedules read them and agree with the bf16 products to bf16 rounding; a cast drops them."""
    experts = make_experts(4).bfloat16()
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 16, generator=gen).bfloat16()
    weights, chosen = sigmoid_topk_routing(torch.randn(num_tokens, 4, generator=gen), torch.zeros(4), 2)
    with torch.inference_mode():
        plain = experts(x, chosen, weights)
        experts.prepack_weights()
        assert all(c.dtype == torch.float32 for c in experts.prepacked)
        packed = experts(x, chosen, weights)
    torch.testing.assert_close(packed, plain, rtol=2e-2, atol=2e-2)
    experts.float()
    assert experts.prepacked is None
