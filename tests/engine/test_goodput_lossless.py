"""The adaptive draft controller through the engine (its choices on planted costs: tests/engine/test_goodput.py).

In float64, greedy output with ``adaptive`` equals plain output token for token for every kind of
proposer, under preemption; the choices are counted in ``num_drafts_histogram``. Lossless by
construction whatever the controller chooses, so a planted controller choosing arbitrary counts per
request and step is held to the same equality. Dormant requests cost what they cost without
speculation: no aux layers captured, no draft state kept.
"""

from __future__ import annotations

import random

import pytest

from specdec import LLM, SamplingParams
from specdec.engine.goodput import GoodputController
from specdec.zoo import zoo_path

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5] * 9, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [100],
           [40, 41, 42, 40, 41]]
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_configs(tiny_checkpoint):
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "model": str(tiny_checkpoint("llama_draft")),
                        "num_speculative_tokens": 3},
    }


@pytest.fixture(scope="module")
def plain_llama(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float64", block_size=4, kv_cache_memory=1 << 22)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


class PlantedChoices(GoodputController):
    """Chooses a seeded random count in 0..cap per request and step: every mix the engine may meet."""

    def __init__(self, k: int):
        super().__init__(k)
        self._random = random.Random(0)

    def choose(self, requests, caps, base_rows):
        return [self._random.randint(0, cap) for cap in caps]


@pytest.mark.parametrize("planted", [False, True], ids=["measured", "planted"])
@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_adaptive_greedy_output_equals_plain_under_preemption(kind, planted, llama_configs, plain_llama,
                                                             tiny_checkpoint):
    config = {**llama_configs[kind], "adaptive": True}
    target = str(tiny_checkpoint("llama"))
    roomy = LLM(target, dtype="float64", block_size=4, kv_cache_memory=1 << 22, speculative_config=config)
    bytes_per_token = sum(p.bytes_per_token() for p in roomy.engine.cache.pools.values())
    # About two requests' worth of pages for five: requests are preempted and recomputed.
    budget = bytes_per_token * 2 * (max(map(len, PROMPTS)) + PARAMS.max_tokens + 3)
    llm = LLM(target, dtype="float64", block_size=4, kv_cache_memory=budget, speculative_config=config)
    if planted:
        llm.engine.draft_counts = PlantedChoices(3)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain_llama
    assert llm.engine.stats.num_preemptions > 0
    histogram = llm.spec_stats().num_drafts_histogram
    assert len(histogram) == 4 and sum(histogram) > 0
    if planted:
        assert all(histogram), histogram  # every count from 0 to k was chosen, and held


ZOO_PROMPTS = [[11, 12, 13, 14, 15, 16], [200, 201, 202], [7] * 12, [300, 301, 302, 303]]


def zoo_adaptive_eagle3(params: SamplingParams) -> tuple[list, LLM]:
    """Plain outputs of the zoo's llama-tiny on ``ZOO_PROMPTS``, and an adaptive EAGLE3 LLM over it
    (float64), for a test to plant a controller in."""
    target = str(zoo_path("llama-tiny"))
    plain = LLM(target, dtype="float64", kv_cache_memory=1 << 22).generate(ZOO_PROMPTS, params, use_tqdm=False)
    llm = LLM(target, dtype="float64", kv_cache_memory=1 << 22, speculative_config={
        "method": "eagle3", "model": str(zoo_path("llama-tiny-eagle3")), "num_speculative_tokens": 3,
        "adaptive": True})
    return [o.token_ids for o in plain], llm


def test_adaptive_eagle3_on_the_zoo_equals_plain():
    expected, llm = zoo_adaptive_eagle3(PARAMS)
    assert [o.token_ids for o in llm.generate(ZOO_PROMPTS, PARAMS, use_tqdm=False)] == expected
    llm.engine.draft_counts = PlantedChoices(3)  # the same engine, its counts now chosen at random
    assert [o.token_ids for o in llm.generate(ZOO_PROMPTS, PARAMS, use_tqdm=False)] == expected


class PlantedDormancy(PlantedChoices):
    """Like :class:`PlantedChoices`, and sends a random tenth of the requests dormant each step."""

    def choose(self, requests, caps, base_rows):
        self._dormant.update(r for r in requests if self._random.random() < 0.1)
        return [0 if r in self._dormant else self._random.randint(0, cap) for r, cap in zip(requests, caps)]


class PlantedWakes(PlantedDormancy):
    """Like :class:`PlantedDormancy`, and wakes a random half of the dormant requests after each step."""

    def to_wake(self, seqs):
        woken = [s for s in seqs if not s.is_finished and s.seq_id in self._dormant and self._random.random() < 0.5]
        self._dormant.difference_update(s.seq_id for s in woken)
        return woken


def test_woken_requests_are_recomputed_draft_again_and_outputs_stay_plain():
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected, llm = zoo_adaptive_eagle3(params)
    engine = llm.engine
    engine.draft_counts = PlantedWakes(3)
    woken, drafted_after, recompute, propose = set(), set(), engine.scheduler.recompute, engine.proposer.propose

    def recording_recompute(seq):
        woken.add(seq.seq_id)
        recompute(seq)

    def recording_propose(seqs, max_drafts):
        out = propose(seqs, max_drafts)
        drafted_after.update(s.seq_id for s, d in zip(seqs, out.draft_token_ids) if d and s.seq_id in woken)
        return out

    engine.scheduler.recompute, engine.proposer.propose = recording_recompute, recording_propose
    assert [o.token_ids for o in llm.generate(ZOO_PROMPTS, params, use_tqdm=False)] == expected
    assert woken and drafted_after  # recomputed requests drafted again (their draft state rebuilt)
    assert engine.stats.num_preemptions == 0  # a recompute the controller asks for is no preemption
    assert engine.cache.requests() == [] and engine.proposer._states == {}


def test_dormant_requests_keep_no_draft_state_and_outputs_stay_plain():
    expected, llm = zoo_adaptive_eagle3(PARAMS)
    engine = llm.engine
    engine.draft_counts = PlantedDormancy(3)
    captured, run = [], engine.runner.run

    def recording_run(layout, tokens, aux_layer_ids):
        captured.append(bool(aux_layer_ids))
        return run(layout, tokens, aux_layer_ids)

    kept, append = [], engine.proposer._append_hidden

    def recording_append(request, start, hidden):
        kept.append(engine.draft_counts.is_dormant(request))
        return append(request, start, hidden)

    engine.runner.run, engine.proposer._append_hidden = recording_run, recording_append
    assert [o.token_ids for o in llm.generate(ZOO_PROMPTS, PARAMS, use_tqdm=False)] == expected
    assert True in captured and False in captured  # steps whose requests were all dormant captured nothing
    assert kept and not any(kept)  # states were kept, never a dormant request's
    assert llm.spec_stats().num_drafts > 0
