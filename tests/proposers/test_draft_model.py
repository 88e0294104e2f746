"""The draft_model proposer: identical draft accepts everything, vocabulary checks, sampling q."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [100], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _draft(model: str, k: int, **extra) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **extra}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_identical_draft_is_accepted_at_every_position(k, target):
    # 24 generated tokens = whole steps of k + 1 for every k here, so no step is cut short.
    llm = LLM(target, dtype="float64", block_size=4, kv_cache_memory=1 << 22, speculative_config=_draft(target, k))
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    stats = llm.spec_stats()
    assert stats.acceptance_per_position == [1.0] * k
    assert stats.num_accepted_tokens == stats.num_draft_tokens == stats.num_drafts * k
    assert stats.mean_acceptance_length == k + 1
    assert stats.num_drafts == len(PROMPTS) * 24 // (k + 1)
    assert llm.engine.stats.num_steps == 24 // (k + 1)
    assert all(len(o.token_ids) == 24 for o in outputs)


def test_reset_spec_stats(target):
    llm = LLM(target, dtype="float64", kv_cache_memory=1 << 22, speculative_config=_draft(target, 2))
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert llm.spec_stats().num_drafts > 0
    llm.reset_spec_stats()
    assert llm.spec_stats().as_dict()["num_drafts"] == 0
    assert llm.spec_stats().accepted_per_position == [0, 0]


def test_vocabulary_mismatch_is_an_error(target, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(config).to(torch.float64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 64 tokens, the target 128"):
        LLM(target, kv_cache_memory=1 << 20, speculative_config=_draft(str(tmp_path), 2))


def test_bad_draft_block_size_names_the_key(target):
    with pytest.raises(ValueError, match="block_size"):
        LLM(target, kv_cache_memory=1 << 20, speculative_config=_draft(target, 2, block_size=0))
    with pytest.raises(ValueError, match="does not exist"):
        LLM(target, kv_cache_memory=1 << 20, speculative_config=_draft("/no/such/draft", 2))


def test_draft_pool_has_its_own_page_size(target, tiny_checkpoint):
    draft = str(tiny_checkpoint("llama_draft"))
    llm = LLM(target, block_size=4, kv_cache_memory=1 << 20, speculative_config=_draft(draft, 3, block_size=3))
    pools = llm.engine.cache.pools
    assert set(pools) == {"target", "draft"}
    assert (pools["target"].block_size, pools["draft"].block_size) == (4, 3)
    # The budget is split so both pools hold the same number of tokens.
    capacity = llm.engine.cache.capacity()
    assert abs(capacity["target"] - capacity["draft"]) < 4


def test_seeded_sampling_with_a_sampling_draft_is_reproducible(target, tiny_checkpoint):
    draft = str(tiny_checkpoint("llama_draft"))
    config = _draft(draft, 3, draft_sample_method="probabilistic")
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=77, ignore_eos=True)
    llm = LLM(target, dtype="float64", block_size=4, kv_cache_memory=1 << 22, speculative_config=config)
    alone = llm.generate([PROMPTS[2]], seeded, use_tqdm=False)[0].token_ids
    others = [SamplingParams(max_tokens=9, temperature=0.7)] * 4
    params = [others[0], others[1], seeded, others[2], others[3]]
    batched = llm.generate(PROMPTS, params, use_tqdm=False)
    assert batched[2].token_ids == alone
    # Another engine, another seed for the unseeded ones, a budget that preempts: still the same.
    per_token = sum(p.bytes_per_token() for p in llm.engine.cache.pools.values())
    small = LLM(target, dtype="float64", block_size=4, kv_cache_memory=per_token * 60, speculative_config=config, seed=3)
    again = small.generate(PROMPTS[::-1], params[::-1], use_tqdm=False)[::-1]
    assert small.engine.stats.num_preemptions > 0
    assert again[2].token_ids == alone
    assert llm.spec_stats().num_accepted_tokens > 0
