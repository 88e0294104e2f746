"""Greedy speculation is lossless: token for token the non-speculative output, in float64.

Ragged prompts, k in {1, 3, 5}, n-gram and draft-model proposers (a smaller llama and a draft of
another architecture), with a roomy cache and with one so small that requests are preempted
and recomputed mid-generation (their draft pools too).
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
