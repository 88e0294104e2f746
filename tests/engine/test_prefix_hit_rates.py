"""Speculation keeps prefix reuse: the prefix-cache hit rate with a proposer equals the rate without.

On the zoo's llama-tiny pair (float32, 16-token pages) with two workloads: requests over a few long
system prompts (lengths not multiples of the page size, and one that is), and multi-turn conversations
whose turn n + 1 extends turn n's prompt and output. The workload's prompts are fixed once (from a plain
run), then replayed by every configuration, so the rates compare caching alone. ``ngram`` and
``eagle3-unshifted`` with kv sharing (its draft holds no prompt pages) reuse what the plain engine
reuses at no cost. Shifted ``eagle3`` keys its draft pages with the token after them, so a request
whose system prompt ends on a page boundary finds the draft's last page computed for another successor;
the unshifted draft without sharing needs h_(p-1) for its row p. Both keep the target's reuse and have
the target recompute those rows for their hidden states (``PrefixCacheStats.recomputed``, pinned here
as the cost).
"""

from __future__ import annotations

import random

import pytest

from specdec import LLM, SamplingParams

ZOO = "specdec/zoo/"
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
CONFIGS = {
    "ngram": "ngram:num_speculative_tokens=3",
    "eagle3": f"eagle3:model={ZOO}llama-tiny-eagle3,num_speculative_tokens=3",
    "eagle3-unshifted": f"eagle3-unshifted:model={ZOO}llama-tiny-eagle3-unshifted,num_speculative_tokens=3",
    "eagle3-unshifted-own": f"eagle3-unshifted:model={ZOO}llama-tiny-eagle3-unshifted,num_speculative_tokens=3,"
                            "kv_sharing=false",
}


def _llm(config=None) -> LLM:
    return LLM(ZOO + "llama-tiny", dtype="float32", kv_cache_memory=32 << 20, speculative_config=config)


@pytest.fixture(scope="module")
def workloads():
    rng = random.Random(7)
    words = lambda n: [rng.randrange(5, 4000) for _ in range(n)]  # noqa: E731
    systems = [words(n) for n in (101, 128, 75)]
    shared = [[systems[i % 3] + words(rng.randrange(5, 20)) for i in range(j, j + 3)] for j in (0, 3)]
    plain = _llm()
    conversations, turns = [words(40), words(57)], []
    for _ in range(3):
        turns.append([list(c) for c in conversations])
        outputs = plain.generate(conversations, PARAMS, use_tqdm=False)
        conversations = [c + o.token_ids + words(9) for c, o in zip(conversations, outputs)]
    return {"shared-prefix": shared, "multi-turn": turns}


def _rates(config, workloads, recomputed=None) -> dict:
    rates = {}
    for name, waves in workloads.items():
        llm = _llm(config)
        for wave in waves:  # each wave after the last one finished: reuse across steps and calls
            llm.generate(wave, PARAMS, use_tqdm=False)
        rates[name] = llm.prefix_cache_stats()
        if recomputed is not None:
            recomputed[name] = llm.engine.prefix_cache_stats().recomputed
    return rates


@pytest.fixture(scope="module")
def plain_rates(workloads):
    rates = _rates(None, workloads)
    assert all(r["hits"] > 0 for r in rates.values())
    return rates


@pytest.mark.parametrize("method", ["ngram", "eagle3", "eagle3-unshifted", "eagle3-unshifted-own"])
def test_speculation_keeps_the_hit_rate(method, workloads, plain_rates):
    recomputed: dict = {}
    assert _rates(CONFIGS[method], workloads, recomputed) == plain_rates
    if method in ("ngram", "eagle3-unshifted"):
        assert recomputed == {"shared-prefix": 0, "multi-turn": 0}
    elif method == "eagle3":
        # The 128-token system prompt ends on a page: its second request recomputes that page.
        assert recomputed["shared-prefix"] == 16
    else:
        # One position per request that reuses anything (h_(p-1) at the boundary).
        assert recomputed["multi-turn"] == 4 and recomputed["shared-prefix"] == 3
