"""The speculative engine step on a scripted proposer: stats and trace against a hand count,
and drafts capped by max_tokens / max_model_len."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.backends import get_backend
from specdec.cache import PagedKVCache
from specdec.engine.engine import LLMEngine
from specdec.models import load_model
from specdec.outputs import trace_entries
from specdec.proposers.base import Proposal, ProposerBase

VOCAB = 128
PROMPTS = [[1, 2, 3], [5] * 9]


class ScriptedProposer(ProposerBase):
    """Drafts from the known greedy continuation: per request and output length, a pattern of
    'C' (the right token) and 'W' (a wrong one); capped at what the engine allows."""

    def __init__(self, k, continuations, scripts):
        self.num_speculative_tokens = k
        self.continuations = continuations
        self.scripts = scripts
        self.offers: list[tuple[int, int, int]] = []  # (request index, tokens so far, max_drafts)

    def propose(self, seqs, max_drafts):
        drafts = []
        for seq, limit in zip(seqs, max_drafts):
            self.offers.append((seq.index, seq.num_tokens, limit))
            done = seq.num_output_tokens
            pattern = self.scripts[seq.index].get(done, "C" * self.num_speculative_tokens)[:limit]
            truth = self.continuations[seq.index]
            drafts.append([truth[done + j] if c == "C" else (truth[done + j] + 1) % VOCAB for j, c in enumerate(pattern)])
        return Proposal(drafts)


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def greedy(target):
    llm = LLM(target, dtype="float64", kv_cache_memory=1 << 22)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)]


def _engine(target, proposer, **kw):
    model = load_model(target, dtype="float64")
    return LLMEngine(model, PagedKVCache(1 << 22), get_backend("torch"), proposer=proposer, block_size=4, **kw)


def test_stats_and_trace_match_a_hand_count(target, greedy):
    g, h = greedy
    scripts = [
        {0: "CCC", 4: "CWC", 6: "", 7: "W", 8: "CC"},  # 4 + 2 + 1 + 1 + 3 = 11 tokens
        {0: "", 1: "W", 2: "C"},  # the last offer is capped to 0 drafts (one token left)
    ]
    proposer = ScriptedProposer(3, greedy, scripts)
    engine = _engine(target, proposer)
    steps = []
    params = [SamplingParams(max_tokens=11, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True)]
    seqs = engine.generate(PROMPTS, params, on_step=steps.append)
    assert [s.output_token_ids for s in seqs] == [g[:11], h[:3]]
    w = lambda t: (t + 1) % VOCAB  # noqa: E731
    assert trace_entries(steps) == [
        {"step": 0, "request": 0, "num_drafts_chosen": 3, "draft_token_ids": g[0:3], "num_accepted": 3, "emitted_token_ids": g[0:4]},
        {"step": 1, "request": 0, "num_drafts_chosen": 3, "draft_token_ids": [g[4], w(g[5]), g[6]], "num_accepted": 1,
         "emitted_token_ids": g[4:6]},
        {"step": 1, "request": 1, "num_drafts_chosen": 1, "draft_token_ids": [w(h[1])], "num_accepted": 0, "emitted_token_ids": [h[1]]},
        {"step": 3, "request": 0, "num_drafts_chosen": 3, "draft_token_ids": [w(g[7])], "num_accepted": 0, "emitted_token_ids": [g[7]]},
        {"step": 4, "request": 0, "num_drafts_chosen": 2, "draft_token_ids": g[8:10], "num_accepted": 2, "emitted_token_ids": g[8:11]},
    ]
    stats = engine.spec_stats.as_dict()
    assert stats == {
        "num_drafts": 5,
        "num_draft_tokens": 10,
        "num_accepted_tokens": 6,
        "accepted_per_position": [3, 2, 1],
        "acceptance_per_position": [0.6, 0.4, 0.2],
        "mean_acceptance_length": 2.2,
        "draft_acceptance_rate": 0.6,
        # Offers given j drafts (a fixed k gives min(k, cap)): request 0 got 3 at outputs 0, 4, 6
        # and 7 and 2 at 8; request 1 got 2 then 1 (its offer capped to 0 is not counted).
        "num_drafts_histogram": [0, 1, 2, 4],
        "num_drafts_by_verifier": {"greedy": 5},  # every request greedy: every draft to the greedy verifier
        "warnings": [],
    }
    assert engine.stats.num_steps == 5
    # Step 2 had no drafts at all (request 0's empty pattern, request 1 capped): plain sampling.
    assert (1, 11, 0) in proposer.offers


@pytest.mark.parametrize("max_model_len", [None, 14])
def test_drafts_never_run_past_max_tokens_or_max_model_len(target, greedy, max_model_len):
    k = 5
    proposer = ScriptedProposer(k, greedy, [{}, {}])  # always offers all k, all correct
    engine = _engine(target, proposer, max_model_len=max_model_len)
    params = [SamplingParams(max_tokens=13, ignore_eos=True), SamplingParams(max_tokens=8, ignore_eos=True)]
    seqs = engine.generate(PROMPTS, params)
    limits = [min(len(p) + sp.max_tokens, max_model_len or 10**9) for p, sp in zip(PROMPTS, params)]
    assert [s.num_tokens for s in seqs] == limits
    assert [s.output_token_ids for s in seqs] == [greedy[i][: limits[i] - len(PROMPTS[i])] for i in range(2)]
    for index, num_tokens, max_drafts in proposer.offers:
        assert max_drafts == max(0, min(k, limits[index] - num_tokens - 1))
    assert all(s.finish_reason == "length" for s in seqs)
