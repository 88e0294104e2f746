"""Two ranks give what one gives: float64, the zoo's llama, DeepSeek-V3 (Kimi-K2) and MiniMax-M3
targets with every proposer that applies to each, under a per-rank KV budget tight enough that
requests are preempted and recomputed.

For each (target, proposer) one two-rank ``LLM`` (this process the driver, one spawned gloo worker)
runs the workload of ``tp_workload.py``. The reference is one rank with a cache of the same capacity
in tokens (a rank of two holds fewer bytes per token where KV heads split), so the two schedule
alike: the same steps and preemptions, the same drafts and acceptances, the same greedy tokens and
logprobs (to rounding), and the same seeded sampled tokens. (Seeded sampling with a model-based draft
is not invariant to *when* requests are preempted: a recomputed request's draft can propose other
tokens, and a sampled verification depends on the proposals, so the capacities must match.) Greedy
tokens also equal the plain target's with a roomy cache: speculation stays lossless.
"""

from __future__ import annotations

import pytest
from tp_workload import (
    K,
    MODEL_DRAFTS,
    SCENARIOS,
    TIGHT_TOKENS,
    WHOLE_DRAFTS,
    bytes_per_token,
    make_llm,
    prompts,
    run,
    tensor_parallel_llm,
)

from specdec.train.corpus import validation_prompts
from specdec.zoo import zoo_path


@pytest.fixture(scope="module")
def windows() -> list[list[int]]:
    """Held-out corpus windows (every zoo target shares the tokenizer), so the drafts really accept."""
    return validation_prompts(zoo_path("llama-tiny"), 5, 130)


@pytest.fixture(scope="module")
def plain(windows):
    """``plain(target)``: the workload on one rank without speculation, roomy cache."""
    done: dict = {}

    def get(target: str) -> dict:
        if target not in done:
            done[target] = run(make_llm(target, "none"), prompts(windows, target))
            assert done[target]["engine"]["preemptions"] == 0
        return done[target]

    return get


def _same_logprobs(got, want) -> None:
    assert [t for t, _, _ in got] == [t for t, _, _ in want]
    for (_, a, top_a), (_, b, top_b) in zip(got, want):
        # The ranks' partial sums add up in another order than one rank's: equal to rounding.
        assert a == pytest.approx(b, abs=1e-9)
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert [p for _, p in top_a] == pytest.approx([p for _, p in top_b], abs=1e-9)


@pytest.mark.parametrize("target,proposer", SCENARIOS, ids=[f"{t}-{p}" for t, p in SCENARIOS])
def test_two_ranks_equal_one_rank_greedy_and_sampled_with_preemption(target, proposer, windows, plain):
    batch = prompts(windows, target)
    one_rank_per_token = bytes_per_token(make_llm(target, proposer))
    budget = one_rank_per_token * TIGHT_TOKENS[target]
    with tensor_parallel_llm(target, proposer, kv_cache_memory=budget) as llm:
        got = run(llm, batch)
        capacity = llm.engine.cache.capacity()
        per_token = bytes_per_token(llm)
        target_pool = llm.engine.cache.pool("target").bytes_per_token()
    # One rank with the same capacity in tokens: the same schedule.
    reference = make_llm(target, proposer, kv_cache_memory=budget // per_token * one_rank_per_token)
    assert reference.engine.cache.capacity() == capacity
    want = run(reference, batch)

    assert got["engine"]["preemptions"] > 0, "the per-rank budget preempted nothing: recompute went untested"
    assert got["greedy"] == want["greedy"]
    assert got["greedy"] == plain(target)["greedy"], "speculation under tensor parallelism is not lossless"
    _same_logprobs(got["logprobs"], want["logprobs"])
    assert got["sampled"] == want["sampled"]
    assert got["sampled"] != got["greedy"], "sampling gave the greedy tokens: the check would be vacuous"
    assert got["sampled"][2] == got["greedy"][2]  # the greedy request of the sampling batch
    assert got["engine"] == want["engine"]  # steps, preemptions, drafts and acceptances alike
    if proposer != "none":
        assert got["engine"]["spec"]["num_accepted_tokens"] > 0, "nothing accepted: the drafts went untested"

    # A rank holds half the target's KV heads (llama, MiniMax-M3: 2 KV heads), or all of MLA's latent.
    halves = reference.engine.cache.pool("target").bytes_per_token() // (1 if target == "kimi" else 2)
    assert target_pool == halves

    # The driver's collectives by phase: the target's, the per-step control broadcast, and the draft's
    # only for a model-based draft (ngram drafts on every rank alike, from the tokens).
    for call in ("greedy", "sampled"):
        sent, calls = got["sent"][call]
        assert sent.get("target", 0) > 0 and sent.get("control", 0) > 0, sent
        assert (sent.get("draft", 0) > 0) == (proposer in MODEL_DRAFTS), sent
    if proposer in WHOLE_DRAFTS:
        # A greedy draft step on a whole-on-every-rank layer exchanges a (max, id) pair per row, never
        # the vocabulary: at most 2 float64 per row (one per request and draft position) per collective.
        sent, calls = got["sent"]["greedy"]
        assert sent["draft"] <= calls["draft"] * 2 * 8 * len(batch) * (K + 1), (sent, calls)
