"""Speculation is lossless.

Greedy: token for token the non-speculative output, in float64, for ragged prompts, k in
{1, 3, 5}, n-gram and draft-model proposers (a smaller llama and a draft of another
architecture), with a roomy cache and with one so small that requests are preempted and
recomputed mid-generation (their draft pools too).

Sampling: through the whole engine (a draft model drawing its drafts from q, rejection sampler), the
first two tokens of thousands of seeded requests follow the target's exact joint law (chi-squared),
at temperature 1 and with top-p; an always-accept verifier fails the same test. (Deterministic drafts
go to the coupled verifier, whose output is plain sampling's token for token:
tests/engine/test_sampled_exact.py.)
"""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams

# Repetitive prompts give the n-gram proposer matches; lengths straddle the 4-token pages.
PROMPTS = [
    [1, 2, 3, 4, 1, 2, 3, 4, 1, 2],
    [5] * 9,
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
    [100],
    [40, 41, 42, 40, 41],
]
MAX_TOKENS = 24
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def baseline(target):
    llm = LLM(target, dtype="float64", block_size=4, kv_cache_memory=1 << 22)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _config(kind: str, k: int, tiny_checkpoint) -> dict:
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    draft = {"draft_model": "llama_draft", "draft_model-qwen3": "qwen3"}[kind]
    # Draft pages of 3 tokens against the target's 4: the pools must not be unified.
    return {"method": "draft_model", "model": str(tiny_checkpoint(draft)), "num_speculative_tokens": k, "block_size": 3}


def _bytes_per_token(llm: LLM) -> int:
    return sum(p.bytes_per_token() for p in llm.engine.cache.pools.values())


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("kind", ["ngram", "draft_model", "draft_model-qwen3"])
def test_greedy_speculation_is_lossless(kind, k, target, baseline, tiny_checkpoint):
    config = _config(kind, k, tiny_checkpoint)
    llm = LLM(target, dtype="float64", block_size=4, kv_cache_memory=1 << 22, speculative_config=config)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outputs] == baseline
    stats = llm.spec_stats()
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert len(stats.accepted_per_position) == k
    if kind == "ngram":
        assert stats.num_accepted_tokens > 0  # the repetitive prompts are found
    # Fewer target forwards than tokens whenever anything was accepted.
    assert llm.engine.stats.num_steps <= MAX_TOKENS


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_lossless_under_preemption(kind, k, target, baseline, tiny_checkpoint):
    config = _config(kind, k, tiny_checkpoint)
    roomy = LLM(target, dtype="float64", block_size=4, kv_cache_memory=1 << 22, speculative_config=config)
    # About two requests' worth of pages (target and draft pools together) for five requests.
    budget = _bytes_per_token(roomy) * 2 * (max(map(len, PROMPTS)) + MAX_TOKENS + k)
    llm = LLM(target, dtype="float64", block_size=4, kv_cache_memory=budget, speculative_config=config)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    assert [o.token_ids for o in outputs] == baseline
    # Every page came back: nothing leaks through preemption, rollback or finishing.
    cache = llm.engine.cache
    assert cache.requests() == []
    assert all(cache.num_free_blocks(name) == pool.num_blocks for name, pool in cache.pools.items())


def test_mixed_greedy_and_sampled_requests_share_steps(target, baseline, tiny_checkpoint):
    config = _config("draft_model", 3, tiny_checkpoint)
    llm = LLM(target, dtype="float64", block_size=4, kv_cache_memory=1 << 22, speculative_config=config)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    params = [PARAMS, sampled, PARAMS, sampled, PARAMS]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for i in (0, 2, 4):
        assert outputs[i].token_ids == baseline[i]
    assert all(len(o.token_ids) == MAX_TOKENS for o in outputs)


# ----- the sampled law, end to end through the engine -----

LAW_VOCAB = 6
LAW_PROMPT = [1, 2, 3]
LAW_REQUESTS = 3000


def _law_checkpoint(folder, seed: int, hidden: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=LAW_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         initializer_range=0.5, eos_token_id=None, bos_token_id=None)
    LlamaForCausalLM(config).to(torch.float64).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def law_models(tmp_path_factory):
    return (_law_checkpoint(tmp_path_factory.mktemp("law_target"), 0, 16),
            _law_checkpoint(tmp_path_factory.mktemp("law_draft"), 1, 8))


def _exact_joint_law(target: str, params: SamplingParams):
    """P(t1, t2) of the first two sampled tokens, from the target's own logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.sampling import target_probs

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64)
    rows = torch.tensor([LAW_PROMPT + [t] for t in range(LAW_VOCAB)])
    with torch.no_grad():
        first = model(torch.tensor([LAW_PROMPT])).logits[0, -1:]
        second = model(rows).logits[:, -1]

    def probs(logits):
        n = logits.shape[0]
        return target_probs(logits, torch.full((n,), params.temperature, dtype=torch.float64),
                            torch.full((n,), params.top_k), torch.full((n,), params.top_p, dtype=torch.float64))

    return (probs(first).T * probs(second)).reshape(-1)  # [t1 * V + t2]


def _empirical_counts(target: str, draft: str, params: SamplingParams, verifier=None):
    import torch

    from specdec.backends import get_backend
    from specdec.cache import PagedKVCache
    from specdec.engine import LLMEngine, Scheduler, SchedulerConfig
    from specdec.models import load_model
    from specdec.proposers.draft_model import DraftModelProposer

    engine = LLMEngine(
        load_model(target, dtype="float64"), PagedKVCache(1 << 24), get_backend("torch"),
        scheduler=Scheduler(SchedulerConfig(max_num_seqs=512)),
        proposer=DraftModelProposer(draft, 2, draft_sample_method="probabilistic"), verifier=verifier,
    )
    seqs = engine.generate([LAW_PROMPT] * LAW_REQUESTS,
                           [attrs_evolve(params, seed=i) for i in range(LAW_REQUESTS)])
    assert engine.spec_stats.num_drafts > 0
    cells = torch.tensor([s.output_token_ids[0] * LAW_VOCAB + s.output_token_ids[1] for s in seqs])
    return torch.bincount(cells, minlength=LAW_VOCAB**2).double(), engine.spec_stats


def attrs_evolve(params: SamplingParams, **changes) -> SamplingParams:
    import attrs

    return attrs.evolve(params, **changes)


def _chi2_pvalue(counts, law) -> float:
    from scipy import stats

    keep = law > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    expected = law[keep] * counts.sum()
    return float(stats.chisquare(counts[keep].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_speculation_keeps_the_target_law(top_p, law_models):
    target, draft = law_models
    params = SamplingParams(max_tokens=3, temperature=1.0, top_p=top_p)  # two drafts each
    counts, stats = _empirical_counts(target, draft, params)
    # The draft differs from the target: some drafts are rejected, some accepted.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_drafts_by_verifier == {"rejection": stats.num_drafts}  # drafts drawn from q
    assert _chi2_pvalue(counts, _exact_joint_law(target, params)) > 0.001


def test_always_accept_verifier_fails_the_same_test(law_models):
    import torch

    from specdec.sampling import categorical, target_probs
    from specdec.verifiers.base import assemble

    class AlwaysAccept:
        """Keeps every draft and samples the bonus from p: the law of the drafts, not the target's."""

        name = "always-accept"

        def verify(self, target_logits, draft_token_ids, num_drafts, draft_probs, batch):
            last = torch.cumsum(num_drafts + 1, 0) - 1
            p = target_probs(target_logits[last], batch.temperature, batch.top_k, batch.top_p)
            bonus = categorical(p, batch.seeds, batch.counters + num_drafts, 0)
            return assemble(draft_token_ids.clamp(min=0), num_drafts, bonus)

    target, draft = law_models
    params = SamplingParams(max_tokens=3, temperature=1.0)
    counts, _ = _empirical_counts(target, draft, params, verifier=AlwaysAccept())
    assert _chi2_pvalue(counts, _exact_joint_law(target, params)) < 0.001
