"""FusedExperts: both schedules (every expert on few tokens, routed rows otherwise) give the MoE sum."""

import pytest
import torch

from specdec.models.moe import FusedExperts, sigmoid_topk_routing


def make_experts(num_experts: int, hidden: int = 16, inter: int = 8) -> FusedExperts:
    torch.manual_seed(0)
    experts = FusedExperts(num_experts, hidden, inter, lambda gu: torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:])
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


@pytest.mark.parametrize("num_experts,num_tokens", [(4, 1), (4, 4), (4, 16), (4, 17), (8, 3), (64, 1), (64, 5)])
def test_matches_the_per_token_sum(num_experts, num_tokens):
    experts = make_experts(num_experts)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 16, dtype=torch.float64, generator=gen)
    logits = torch.randn(num_tokens, num_experts, dtype=torch.float64, generator=gen)
    weights, chosen = sigmoid_topk_routing(logits, torch.zeros(num_experts, dtype=torch.float64), 2)
    with torch.inference_mode():
        got = experts(x, chosen, weights)
    torch.testing.assert_close(got, naive(experts, x, chosen, weights), rtol=1e-12, atol=1e-12)


def test_the_two_schedules_agree_and_the_threshold_picks_them():
    experts = make_experts(4)
    x = torch.randn(6, 16, dtype=torch.float64)
    chosen = torch.tensor([[0, 1], [1, 0], [2, 3], [3, 3], [0, 2], [1, 1]])
    torch.testing.assert_close(experts._every_expert(x, chosen), experts._routed_rows(x, chosen), rtol=1e-12, atol=1e-12)
    assert 6 * 4 <= FusedExperts.DENSE_MAX_ROWS  # this batch runs dense...
    assert 256 > FusedExperts.DENSE_MAX_ROWS  # ...and a 256-expert MoE never does, even for one token
