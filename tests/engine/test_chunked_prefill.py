"""Chunked prefill is exact: with ``max_num_batched_tokens`` splitting prompts across steps, every
proposer gives the plain target's greedy output token for token (float64), with prefix caching on
(the default) and off, on Llama, DeepSeek-V3 (MLA) and MiniMax-M3 (128-token pages) targets, and
under preemption.

Budgets of 3, 7 and 16 tokens: none a multiple of the drafts' 3-token pages, 3 and 7 of no page
size, all below k + 1 + a prompt, so chunks end mid-page and decodes with their drafts share (or
fill) a step's budget. Every forward is checked to stay within the budget, and some step must
really have run a prompt chunk. The workload is prefix_workload.py's (shared prefixes, later calls,
a second conversation turn), so chunks also start from cached pages and publish pages for the
requests admitted after them.
"""

from __future__ import annotations

import pytest
from prefix_workload import (
    GREEDY,
    MAX_TOKENS,
    PROPOSERS,
    build_models,
    bytes_per_token,
    make_llm,
    rounds,
    run_workload,
)
from test_scheduler import _cache, _run_chunked_step, _seq

from specdec import SamplingParams
from specdec.engine import Scheduler, SchedulerConfig

BUDGETS = [3, 7, 16]
LLAMA = PROPOSERS["llama"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("chunked_prefill"))


@pytest.fixture(scope="module")
def baseline(models):
    """Plain target, whole prefills, no prefix caching."""
    done: dict = {}

    def get(target: str, params: SamplingParams = GREEDY):
        key = (target, params.temperature)
        if key not in done:
            done[key] = run_workload(make_llm(models, target, "none", caching=False), params)[0]
        return done[key]

    return get


def watch_forwards(llm) -> list[tuple[int, bool]]:
    """Per target forward: (rows, whether some request ran a prompt chunk that samples nothing)."""
    log = []
    run = llm.engine.runner.run

    def recording(layout, *args, **kwargs):
        log.append((layout.num_rows, not all(layout.samples)))
        return run(layout, *args, **kwargs)

    llm.engine.runner.run = recording
    return log


def check_chunked(llm, budget, log) -> None:
    assert max(rows for rows, _ in log) <= budget
    assert any(chunk for _, chunk in log), "no prompt was split: the check would be vacuous"


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("proposer", LLAMA)
def test_chunked_prefill_with_prefix_caching(proposer, budget, models, baseline):
    llm = make_llm(models, "llama", proposer, max_num_batched_tokens=budget)
    log = watch_forwards(llm)
    outputs, _ = run_workload(llm)
    assert outputs == baseline("llama")
    check_chunked(llm, budget, log)
    assert llm.prefix_cache_stats()["hits"] > 0


@pytest.mark.parametrize("proposer", LLAMA)
def test_chunked_prefill_without_prefix_caching(proposer, models, baseline):
    llm = make_llm(models, "llama", proposer, caching=False, max_num_batched_tokens=7)
    log = watch_forwards(llm)
    outputs, _ = run_workload(llm)
    assert outputs == baseline("llama")
    check_chunked(llm, 7, log)
    assert llm.prefix_cache_stats()["hits"] == 0


@pytest.mark.parametrize("target,proposer,budget", [
    ("deepseek", "ngram", 7),
    ("deepseek", "eagle3", 7),
    ("deepseek", "eagle3.1-mla", 7),
    ("minimax", "ngram", 37),  # chunk ends wander across the 128-token pages
    ("minimax", "eagle3", 37),
    ("llama", "eagle3", 1),  # one row per forward: never room for a draft
])
def test_chunked_prefill_other_targets(target, proposer, budget, models, baseline):
    llm = make_llm(models, target, proposer, max_num_batched_tokens=budget)
    log = watch_forwards(llm)
    outputs, _ = run_workload(llm)
    assert outputs == baseline(target)
    check_chunked(llm, budget, log)
    assert llm.prefix_cache_stats()["hits"] > 0


@pytest.mark.parametrize("target,proposer", [("llama", p) for p in LLAMA] + [("deepseek", "eagle3.1-mla")])
def test_chunked_prefill_under_preemption_with_prefix_caching(target, proposer, models, baseline):
    roomy = make_llm(models, target, proposer)
    longest = max(len(p) for batch in rounds(target) for p in batch) + 2 * MAX_TOKENS + 6
    block = roomy.engine.cache.pool("target").block_size
    memory = bytes_per_token(roomy) * (-(-longest // block) + 1) * block
    llm = make_llm(models, target, proposer, memory=memory, max_num_batched_tokens=7)
    log = watch_forwards(llm)
    outputs, _ = run_workload(llm)
    assert outputs == baseline(target)
    check_chunked(llm, 7, log)
    assert llm.engine.stats.num_preemptions > 0


def test_chunked_seeded_sampling_equals_whole_prefills(models, baseline):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=99, ignore_eos=True)
    llm = make_llm(models, "llama", "none", max_num_batched_tokens=7)
    outputs, _ = run_workload(llm, params)
    assert outputs == baseline("llama", params) != baseline("llama")


def test_a_prompt_logprobs_request_runs_whole_and_matches(models):
    """Prompt logprobs are computed with the prompt, so such a prompt is never chunked: it runs whole,
    alone, even past the budget, and its logprobs are those of an unchunked run."""
    prompts = rounds("llama")[0][:2]
    params = SamplingParams(max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    want = make_llm(models, "llama", "eagle3").generate(prompts, params, use_tqdm=False)
    llm = make_llm(models, "llama", "eagle3", max_num_batched_tokens=7)
    log = watch_forwards(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        assert [t.token_id for t in a.prompt_logprobs] == [t.token_id for t in b.prompt_logprobs]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs, b.prompt_logprobs)) < 1e-9
    assert max(rows for rows, _ in log) > 7 and not any(chunk for _, chunk in log)


# ----------------------------------------------------------------------------- the scheduler's budget
def test_token_budget_covers_drafts_and_only_a_final_chunk_gets_them():
    cache = _cache(1000, pools=(("target", 4), ("draft", 3)))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=10))
    scheduler.bind(cache, "target", num_lookahead=3)
    for i, n in enumerate([2, 2, 2, 9]):
        scheduler.add(_seq(i, n))
    steps = []
    for _ in range(12):
        batch, rows = _run_chunked_step(scheduler, cache)  # a chunk carrying drafts fails in there
        assert sum(rows) <= 10
        steps.append(([s.seq_id for s in batch.seqs], batch.num_new_tokens, batch.max_drafts))
    # Two prefills of 2 + 3 drafts fill the budget; then decodes (1 + 3 drafts) first, and the third
    # prompt with what is left (no room for drafts), then one draft.
    assert steps[:3] == [([0, 1], [2, 2], [3, 3]), ([0, 1, 2], [1, 1, 2], [3, 3, 0]), ([0, 1, 2], [1, 1, 1], [3, 3, 1])]
    # The 9-token prompt is admitted once there is budget left: a 3-token chunk without drafts, then
    # its last 6 tokens, which sample.
    assert steps[6] == ([0, 1, 2, 3], [1, 1, 1, 3], [1, 1, 2, 0])
    assert steps[7] == ([0, 1, 2, 3], [1, 1, 1, 6], [0, 0, 1, 0])


def test_a_chunked_admission_reserves_every_cached_page_it_adopts():
    """A request whose draft pool reuses more positions than its first chunk reaches (the target's
    128-token pages against a draft's 16, here 8 against 2) adopts all those pages at once: the
    scheduler must count all of them, or a request scheduled before it in the same step finds its
    reserved pages gone."""
    from specdec.engine import Sequence as EngineSequence
    from specdec.engine.pools import EnginePools
    from specdec.engine.prefix_caching import PrefixCaching
    from specdec.proposers.base import ProposerPools

    cache = _cache(48, pools=(("target", 8), ("draft", 2)))  # 6 target pages, 24 draft pages
    prefix = PrefixCaching(cache, EnginePools(("target",), ProposerPools(own=("draft",))), None)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=6))
    scheduler.bind(cache, "target", 0, prefix)
    # A 15-token request ran and finished: target page 0 and draft pages 0..6 (positions < 14) are cached.
    first = _seq(0, 15)
    cache.append_slots(first.seq_id, 15)
    prefix.publish(first)
    cache.free(first.seq_id)
    cache.append_slots("held elsewhere", 32, ["draft"])  # 16 draft pages: 1 free + 7 cached ones left
    runner = EngineSequence(1, [9, 9, 9], SamplingParams(max_tokens=8, ignore_eos=True), seed=0, max_model_len=1000)
    again = _seq(2, 15)  # the first one's prompt again
    scheduler.add(runner)
    scheduler.add(again)
    batch = scheduler.schedule()
    match = batch.reuse.get(again.seq_id)
    if again in batch.seqs:
        assert match is not None and len(match.blocks["draft"]) == 7
    # What the engine does: adopt the cached pages, then each request computes its rows in every pool
    # it has not filled yet. Nothing may run out of pages.
    for seq in batch.seqs:
        prefix.admit(seq, batch.reuse.get(seq.seq_id))
    for seq, new in zip(batch.seqs, batch.num_new_tokens):
        end = cache.num_tokens(seq.seq_id, "target") + new
        for name in ("target", "draft"):
            have = cache.num_tokens(seq.seq_id, name)
            if end > have:
                cache.append_slots(seq.seq_id, end - have, [name])
