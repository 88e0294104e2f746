"""Rejection sampler: exact reduction to greedy, reproducibility, and the output law (chi-squared)."""

import pytest
import torch
from verify_law import CASES, L0, P_MIN, V, AlwaysAccept, chi2_pvalue, exact_law, simulate

from specdec.sampling import STREAM_DRAFT, Sampler, SamplingBatch, SamplingParams, categorical, target_probs
from specdec.verifiers import GreedyVerifier, RejectionSampler


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sampled_drafter", [True, False], ids=["sampled-q", "one-hot-q"])
def test_first_two_tokens_follow_the_target_law(case, sampled_drafter):
    params = CASES[case]
    p0, joint = exact_law(params)
    tokens = simulate(RejectionSampler(), params, k=2, sampled_drafter=sampled_drafter)
    assert chi2_pvalue(tokens[:, 0], p0) > P_MIN
    assert chi2_pvalue(tokens, joint) > P_MIN


@pytest.mark.parametrize("case", ["temperature=1", "top_p=0.8"])
@pytest.mark.parametrize("sampled_drafter", [True, False], ids=["sampled-q", "one-hot-q"])
def test_always_accept_control_fails_the_same_test(case, sampled_drafter):
    params = CASES[case]
    p0, joint = exact_law(params)
    tokens = simulate(AlwaysAccept(), params, k=2, sampled_drafter=sampled_drafter)
    assert chi2_pvalue(tokens[:, 0], p0) < P_MIN
    assert chi2_pvalue(tokens, joint) < P_MIN


def random_step(gen, num_req, k, vocab, sampled):
    num_drafts = torch.randint(0, k + 1, (num_req,), generator=gen)
    logits = torch.randn(int(num_drafts.sum()) + num_req, vocab, generator=gen, dtype=torch.float64) * 2
    drafts = torch.randint(0, vocab, (num_req, k), generator=gen)
    q = torch.softmax(torch.randn(num_req, k, vocab, generator=gen, dtype=torch.float64), -1) if sampled else None
    return logits, drafts, num_drafts, q


@pytest.mark.parametrize("sampled", [False, True])
def test_greedy_rows_behave_exactly_like_greedy_verifier(sampled):
    gen = torch.Generator().manual_seed(7)
    num_req, k, vocab = 64, 4, 3
    logits, drafts, num_drafts, q = random_step(gen, num_req, k, vocab, sampled)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=i % 3) for i in range(num_req)]
    batch = SamplingBatch.from_params(params, list(range(num_req)), default_seeds=range(num_req))
    got = RejectionSampler().verify(logits, drafts, num_drafts, q, batch)
    want = GreedyVerifier().verify(logits, drafts, num_drafts, q, batch)
    greedy = batch.greedy
    assert greedy.sum() == num_req // 2
    assert torch.equal(got.num_accepted[greedy], want.num_accepted[greedy])
    assert torch.equal(got.output_token_ids[greedy], want.output_token_ids[greedy])


def test_requests_without_drafts_get_exactly_the_plain_sampler_token():
    gen = torch.Generator().manual_seed(3)
    num_req, vocab = 50, 11
    logits = torch.randn(num_req, vocab, generator=gen, dtype=torch.float64)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(num_req)]
    batch = SamplingBatch.from_params(params, [i % 7 for i in range(num_req)])
    res = RejectionSampler().verify(logits, torch.zeros(num_req, 3, dtype=torch.int64), torch.zeros(num_req, dtype=torch.int64), None, batch)
    assert torch.equal(res.output_token_ids[:, 0], Sampler().sample(logits, batch))
    assert res.num_accepted.tolist() == [0] * num_req


def test_seeded_requests_do_not_depend_on_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(11)
    num_req, k, vocab = 30, 3, 6
    logits, drafts, num_drafts, q = random_step(gen, num_req, k, vocab, True)
    params = [SamplingParams(temperature=1.0, seed=1000 + i) for i in range(num_req)]
    positions = list(range(num_req))
    full = RejectionSampler().verify(logits, drafts, num_drafts, q, SamplingBatch.from_params(params, positions))
    # Verify a reversed subset on its own: each kept request must get the same outcome.
    keep = list(range(num_req - 1, -1, -3))
    starts = (torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)).tolist()
    sub_logits = torch.cat([logits[starts[b]: starts[b] + int(num_drafts[b]) + 1] for b in keep])
    sub = RejectionSampler().verify(
        sub_logits, drafts[keep], num_drafts[keep], q[keep],
        SamplingBatch.from_params([params[b] for b in keep], [positions[b] for b in keep]))
    assert torch.equal(sub.output_token_ids, full.output_token_ids[keep])
    again = RejectionSampler().verify(logits, drafts, num_drafts, q, SamplingBatch.from_params(params, positions))
    assert torch.equal(again.output_token_ids, full.output_token_ids)


def test_draft_distribution_equal_to_target_is_always_accepted():
    n, k = 2000, 3
    params = SamplingParams(temperature=1.0, top_k=4)
    batch = SamplingBatch.from_params([params] * n, [0] * n, default_seeds=range(n))
    per_token = batch.expand(torch.full((n,), k + 1))
    logits = L0.expand(n * (k + 1), -1).clone()
    p = target_probs(logits, per_token.temperature, per_token.top_k, per_token.top_p).view(n, k + 1, V)
    drafts = torch.stack([categorical(p[:, j], batch.seeds, batch.counters + j, STREAM_DRAFT) for j in range(k)], 1)
    res = RejectionSampler().verify(logits, drafts, torch.full((n,), k), p[:, :k].contiguous(), batch)
    assert res.num_accepted.tolist() == [k] * n


def test_needs_a_sampling_batch():
    with pytest.raises(ValueError, match="SamplingBatch"):
        RejectionSampler().verify(torch.zeros(1, 3), torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), None, None)
