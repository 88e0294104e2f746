"""Seeded sampled speculation is plain seeded sampling, token for token (issue 24), in float64, and in
bfloat16 under ``batch_invariant`` (where a row's numbers do not depend on its batch either).

Deterministic drafts (ngram, and the model-based proposers with ``draft_sample_method=greedy``) are
checked by the coupled verifier, which emits at every position the plain sampler's own draw. So the
zoo's pairs, on held-out prompts of ragged lengths with per-request temperature, top-k, top-p, seeds
(one engine-assigned) and a greedy request in the batch, at k = 1, 3, 5, under a KV budget so tight
that requests are preempted and recomputed, give exactly what the target gives alone. Rejection
sampling on the same drafts keeps only the law (the control), and drafts drawn from q keep it.
"""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.train.corpus import validation_prompts
from specdec.verifiers import RejectionSampler
from specdec.zoo import zoo_path

TARGETS = {"llama": "llama-tiny", "kimi": "kimi-k2-tiny"}
METHODS = {"ngram": "llama", "draft_model": "llama", "eagle3": "llama", "eagle3-unshifted": "llama",
           "eagle3.1-mla": "kimi"}
LENGTHS = [9, 23, 31, 14, 40]  # across 16-token pages
MAX_TOKENS = 16
ROOMY = 64 << 20
# dtype -> the engine options that make it exact: float64 by its precision, bf16 by batch invariance.
EXACT = {"float64": {}, "bfloat16": {"batch_invariant": True}}
PARAMS = [
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=11),
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, top_p=0.9, seed=12),
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),  # greedy, in sampling steps
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.7, top_k=20, seed=14),
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.2, top_k=50, top_p=0.8),  # engine's seed
]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Held-out windows (the zoo's targets share the tokenizer), so the drafts really accept."""
    windows = validation_prompts(zoo_path("llama-tiny"), len(LENGTHS), max(LENGTHS))
    return [w[:n] for w, n in zip(windows, LENGTHS)]


@pytest.fixture(scope="module")
def plain(prompts):
    """Seeded plain sampling per target and dtype, computed once."""
    done: dict[tuple[str, str], list[list[int]]] = {}

    def get(target: str, dtype: str = "float64") -> list[list[int]]:
        if (target, dtype) not in done:
            llm = LLM(str(zoo_path(TARGETS[target])), dtype=dtype, kv_cache_memory=ROOMY, **EXACT[dtype])
            done[target, dtype] = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        return done[target, dtype]

    return get


def spec_config(method: str, k: int, **keys) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    draft = "draft-model-tiny" if method == "draft_model" else f"{TARGETS[METHODS[method]]}-{method}"
    return {"method": method, "model": str(zoo_path(draft)), "num_speculative_tokens": k, **keys}


def tight_llm(method: str, k: int, dtype: str = "float64", **keys) -> LLM:
    """An engine whose KV budget holds the longest request and one 16-token page more: the five requests
    take turns, and running ones that grow are preempted (asserted by the tests)."""
    target, config = str(zoo_path(TARGETS[METHODS[method]])), spec_config(method, k, **keys)
    roomy = LLM(target, dtype=dtype, kv_cache_memory=ROOMY, speculative_config=config)
    per_token = sum(p.bytes_per_token() for p in roomy.engine.cache.pools.values())
    budget = per_token * (max(LENGTHS) + MAX_TOKENS + k + 16)
    return LLM(target, dtype=dtype, kv_cache_memory=budget, speculative_config=config, **EXACT[dtype])


@pytest.mark.parametrize("dtype", list(EXACT))
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", list(METHODS))
def test_seeded_sampling_with_deterministic_drafts_is_plain_sampling(method, k, dtype, prompts, plain):
    llm = tight_llm(method, k, dtype, **({} if method == "ngram" else {"draft_sample_method": "greedy"}))
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain(METHODS[method], dtype)
    assert llm.engine.stats.num_preemptions > 0
    stats = llm.spec_stats()
    assert stats.num_accepted_tokens > 0, "nothing accepted: the check would be vacuous"
    # Sampling steps went to the coupled verifier (the greedy one only once every request left is greedy).
    assert set(stats.num_drafts_by_verifier) <= {"coupled", "greedy"} and stats.num_drafts_by_verifier["coupled"] > 0
    assert sum(stats.num_drafts_by_verifier.values()) == stats.num_drafts


def test_rejection_sampling_on_the_same_drafts_keeps_the_law_not_the_tokens(prompts, plain):
    llm = LLM(str(zoo_path("llama-tiny")), dtype="float64", kv_cache_memory=ROOMY,
              speculative_config=spec_config("eagle3", 3, draft_sample_method="greedy"))
    llm.engine.verifiers.fixed = RejectionSampler()
    outputs = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert outputs != plain("llama")
    assert outputs[2] == plain("llama")[2]  # the greedy request's tokens are the argmax's either way
    assert llm.spec_stats().num_drafts_by_verifier == {"rejection": llm.spec_stats().num_drafts}


def test_drafts_drawn_from_q_keep_rejection_sampling(prompts):
    """The default ``draft_sample_method`` is probabilistic: drafts come with q and go to rejection
    sampling; an all-greedy batch drafts the argmax and goes to the greedy verifier."""
    llm = LLM(str(zoo_path("llama-tiny")), dtype="float64", kv_cache_memory=ROOMY,
              speculative_config=spec_config("draft_model", 3))
    llm.generate(prompts[:2], PARAMS[:2], use_tqdm=False)
    assert set(llm.spec_stats().num_drafts_by_verifier) == {"rejection"}
    llm.reset_spec_stats()
    llm.generate(prompts[:2], PARAMS[2], use_tqdm=False)
    assert set(llm.spec_stats().num_drafts_by_verifier) == {"greedy"}
