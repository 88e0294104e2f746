"""Coupled verifier: each emitted token is the plain sampler's for its position, so the output is plain
sampling's token for token; greedy rows are the greedy verifier's; the output law is the target's
(chi-squared), and a coupled verifier that redraws at a mismatch fails the same test."""

import attrs
import pytest
import torch
from verify_law import CASES, L0, L1, N_TRIALS, P_MIN, V, chi2_pvalue, exact_law, simulate

from specdec.sampling import STREAM_RESIDUAL, Sampler, SamplingBatch, SamplingParams, categorical, target_probs
from specdec.verifiers import CoupledVerifier, GreedyVerifier, RejectionSampler, get_verifier
from specdec.verifiers.base import VerifyResult


def ragged_step(seed: int, num_req: int, k: int, vocab: int):
    """Random logits and drafts, 0..k drafts per request, per-request parameters (greedy rows among them),
    seeds and positions; a tiny vocabulary so that drafts often equal the draws."""
    gen = torch.Generator().manual_seed(seed)
    num_drafts = torch.randint(0, k + 1, (num_req,), generator=gen)
    logits = torch.randn(int(num_drafts.sum()) + num_req, vocab, generator=gen, dtype=torch.float64) * 2
    drafts = torch.randint(0, vocab, (num_req, k), generator=gen)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=2),
             SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=0.9, top_k=3, top_p=0.8)]
    params = [attrs.evolve(kinds[i % len(kinds)], seed=100 + i) for i in range(num_req)]
    positions = torch.randint(0, 50, (num_req,), generator=gen).tolist()
    return logits, drafts, num_drafts, SamplingBatch.from_params(params, positions)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_each_emitted_token_is_the_plain_sampler_s_for_its_position(k):
    logits, drafts, num_drafts, batch = ragged_step(k, 60, k, 3)
    res = CoupledVerifier().verify(logits, drafts, num_drafts, None, batch)
    row = 0
    for b in range(len(batch)):
        # The plain sampler, one request and one position at a time.
        plain = [int(Sampler().sample(logits[row + j : row + j + 1], attrs.evolve(
            batch.select(torch.tensor([b])), counters=batch.counters[b : b + 1] + j))) for j in range(num_drafts[b] + 1)]
        accepted = 0
        while accepted < num_drafts[b] and int(drafts[b, accepted]) == plain[accepted]:
            accepted += 1
        assert int(res.num_accepted[b]) == accepted
        assert res.emitted()[b] == plain[: accepted + 1]
        row += int(num_drafts[b]) + 1
    assert 0 < int(res.num_accepted.sum()) < int(num_drafts.sum())  # both outcomes were met


def test_greedy_rows_behave_exactly_like_greedy_verifier():
    logits, drafts, num_drafts, batch = ragged_step(9, 60, 4, 3)
    got = CoupledVerifier().verify(logits, drafts, num_drafts, None, batch)
    want = GreedyVerifier().verify(logits, drafts, num_drafts)
    greedy = batch.greedy
    assert int(greedy.sum()) == 12
    assert torch.equal(got.num_accepted[greedy], want.num_accepted[greedy])
    assert torch.equal(got.output_token_ids[greedy], want.output_token_ids[greedy])


def plain_chain(params: SamplingParams, num_tokens: int, n: int = 2000) -> torch.Tensor:
    """The toy language sampled without speculation, position by position, as ``simulate`` seeds it."""
    batch = SamplingBatch.from_params([params] * n, [0] * n, default_seeds=range(12345, 12345 + n))
    out = torch.empty(n, num_tokens, dtype=torch.int64)
    for pos in range(num_tokens):
        logits = L0.expand(n, -1) if pos == 0 else L1[out[:, pos - 1]]
        out[:, pos] = Sampler().sample(logits, attrs.evolve(batch, counters=torch.full((n,), pos)))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_output_is_plain_sampling_token_for_token(case):
    params = CASES[case]
    plain = plain_chain(params, 6)
    for k in (1, 3, 5):
        assert torch.equal(simulate(CoupledVerifier(), params, k, sampled_drafter=False, num_tokens=6, n=2000), plain)
    # Rejection sampling keeps the law, not the tokens: the same trials come out otherwise.
    rejection = simulate(RejectionSampler(), params, 3, sampled_drafter=False, num_tokens=6, n=2000)
    assert not torch.equal(rejection, plain)


@pytest.mark.parametrize("case", list(CASES))
def test_first_two_tokens_follow_the_target_law(case):
    params = CASES[case]
    p0, joint = exact_law(params)
    tokens = simulate(CoupledVerifier(), params, k=2, sampled_drafter=False)
    assert chi2_pvalue(tokens[:, 0], p0) > P_MIN
    assert chi2_pvalue(tokens, joint) > P_MIN


class RedrawOnMismatch:
    """Negative control: the coupled verifier with a plausible bug. At the first mismatch it emits a fresh
    draw from p (another stream) instead of the draw it compared, which can be the refused draft again:
    a draft x comes out with probability p(x) + (1 - p(x)) p(x)."""

    def verify(self, target_logits, draft_token_ids, num_drafts, draft_probs, batch):
        res = CoupledVerifier().verify(target_logits, draft_token_ids, num_drafts, draft_probs, batch)
        rows = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1) + res.num_accepted
        p = target_probs(target_logits[rows], batch.temperature, batch.top_k, batch.top_p)
        fresh = categorical(p, batch.seeds, batch.counters + res.num_accepted, STREAM_RESIDUAL)
        last = res.output_token_ids.gather(1, res.num_accepted.unsqueeze(1)).squeeze(1)
        final = torch.where(res.num_accepted < num_drafts, fresh, last)
        out = res.output_token_ids.scatter(1, res.num_accepted.unsqueeze(1), final.unsqueeze(1))
        return VerifyResult(res.num_accepted, out, res.num_emitted)


@pytest.mark.parametrize("case", ["temperature=1", "top_p=0.8"])
def test_redraw_on_mismatch_control_fails_the_same_test(case):
    params = CASES[case]
    p0, joint = exact_law(params)
    tokens = simulate(RedrawOnMismatch(), params, k=2, sampled_drafter=False, n=N_TRIALS)
    assert chi2_pvalue(tokens[:, 0], p0) < P_MIN
    assert chi2_pvalue(tokens, joint) < P_MIN


def test_needs_a_sampling_batch_and_is_registered():
    with pytest.raises(ValueError, match="SamplingBatch"):
        CoupledVerifier().verify(torch.zeros(1, V), torch.zeros(1, 0, dtype=torch.int64),
                                 torch.zeros(1, dtype=torch.int64), None, None)
    assert get_verifier("coupled").name == "coupled"
