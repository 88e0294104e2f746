"""Greedy generation through ``LLM`` equals transformers' ``generate(do_sample=False)``, float64.

Ragged prompts run batched (prefills and decodes mixed, pages of 4 tokens); the small-budget run
forces preemption and recomputation, which must not change a single token.
"""

from __future__ import annotations

import pytest

from hf_generate import hf_greedy
from specdec import LLM, SamplingParams

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [100], [40, 41, 42, 43, 44]]
MAX_TOKENS = 20
ARCHES = ["llama", "qwen3", "deepseek_v3", "minimax_m2"]


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    cache = {}

    def get(arch, ignore_eos=False):
        key = (arch, ignore_eos)
        if key not in cache:
            cache[key] = hf_greedy(tiny_checkpoint(arch), PROMPTS, MAX_TOKENS, ignore_eos=ignore_eos)
        return cache[key]

    return get


@pytest.mark.parametrize("arch", ARCHES)
def test_batched_greedy_matches_transformers(arch, tiny_checkpoint, expected):
    llm = LLM(str(tiny_checkpoint(arch)), dtype="float64", block_size=4, kv_cache_memory=1 << 22)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected(arch)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert llm.engine.stats.num_preemptions == 0
    for o in outputs:
        assert o.finish_reason == ("stop" if o.token_ids[-1] == 2 else "length")
        assert o.finish_reason == "stop" or len(o.token_ids) == MAX_TOKENS


@pytest.mark.parametrize("arch", ARCHES)
def test_preemption_keeps_outputs(arch, tiny_checkpoint, expected):
    # Room for about two full requests: the five must take turns through preemption.
    per_token = _bytes_per_token(LLM(str(tiny_checkpoint(arch)), dtype="float64", block_size=4, kv_cache_memory=1 << 20))
    llm = LLM(str(tiny_checkpoint(arch)), dtype="float64", block_size=4, kv_cache_memory=per_token * 64)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected(arch, ignore_eos=True)
    assert all(o.finish_reason == "length" for o in outputs)


def _bytes_per_token(llm: LLM) -> int:
    return sum(p.bytes_per_token() for p in llm.engine.cache.pools.values())
