"""Scheduler and Sequence on a real paged cache (the forward is replaced by its page bookkeeping)."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest
import torch

from specdec.cache import AttentionPool, PagedKVCache
from specdec.engine import Scheduler, SchedulerConfig, Sequence, SequenceStatus
from specdec.engine.prefix_caching import PrefixMatch
from specdec.sampling import SamplingParams


def _cache(tokens: int, pools=(("target", 4),)) -> PagedKVCache:
    """A cache whose every pool holds ``tokens`` tokens (bytes per token = 1 * 1 * 1 * 2 * 8)."""
    cache = PagedKVCache(memory_budget=tokens * 16 * len(pools))
    for name, block in pools:
        cache.register(AttentionPool(name, num_layers=1, block_size=block, num_kv_heads=1, head_dim=1, dtype=torch.float64))
    cache.build()
    return cache


def _seq(i: int, prompt_len: int, max_tokens: int = 8, max_model_len: int = 1000, **kw) -> Sequence:
    return Sequence(i, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw),
                    seed=0, max_model_len=max_model_len, index=i)


def _run_step(scheduler: Scheduler, cache: PagedKVCache):
    """What the engine does to the cache in a step with no drafts accepted: free the preempted, grow,
    emit, trim, free the finished."""
    batch = scheduler.schedule()
    for seq in batch.preempted:
        cache.free(seq.seq_id)
    for seq, drafts in zip(batch.seqs, batch.max_drafts):
        new = seq.num_tokens - cache.num_tokens(seq.seq_id, "target") + drafts
        cache.append_slots(seq.seq_id, new)  # must never raise: the scheduler reserved it
        seq.append([7])
        if seq.is_finished:
            scheduler.finish(seq)
            cache.free(seq.seq_id)
        else:
            cache.truncate(seq.seq_id, seq.num_tokens - 1)
    return batch


def test_admits_up_to_max_num_seqs_and_mixes_prefill_with_decode():
    cache = _cache(1000)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2))
    scheduler.bind(cache, "target")
    seqs = [_seq(i, 5) for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    first = _run_step(scheduler, cache)
    assert [s.seq_id for s in first.seqs] == [0, 1]
    assert seqs[2].status is SequenceStatus.WAITING
    for _ in range(7):
        _run_step(scheduler, cache)
    assert seqs[0].is_finished and seqs[1].is_finished
    # The third was admitted as soon as a slot freed: it is now decoding.
    batch = _run_step(scheduler, cache)
    assert [s.seq_id for s in batch.seqs] == [2]


def _run_chunked_step(scheduler: Scheduler, cache: PagedKVCache):
    """:func:`_run_step` for steps that may hold prompt chunks: a request computes its scheduled rows
    (plus drafts); only one whose rows reach its last token emits. Returns (batch, rows per request)."""
    batch = scheduler.schedule()
    for seq in batch.preempted:
        cache.free(seq.seq_id)
    rows = []
    for seq, new, drafts in zip(batch.seqs, batch.num_new_tokens, batch.max_drafts):
        cached = cache.num_tokens(seq.seq_id, "target")
        rows.append(new + drafts)
        cache.append_slots(seq.seq_id, new + drafts)  # must never raise: the scheduler reserved it
        if cached + new < seq.num_tokens:
            assert drafts == 0, "a chunk that ends mid-prompt carries no drafts"
            continue
        assert cached + new == seq.num_tokens
        seq.append([7])
        if seq.is_finished:
            scheduler.finish(seq)
            cache.free(seq.seq_id)
        else:
            cache.truncate(seq.seq_id, seq.num_tokens - 1)
    return batch, rows


def test_token_budget_chunks_a_long_prefill_and_schedules_decodes_first():
    cache = _cache(1000)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=10))
    scheduler.bind(cache, "target")
    seqs = [_seq(i, n) for i, n in enumerate([12, 4, 4, 4])]
    for s in seqs:
        scheduler.add(s)

    def step():
        batch, rows = _run_chunked_step(scheduler, cache)
        return [s.seq_id for s in batch.seqs], batch.num_new_tokens, rows

    # 12 > 10: the first 10 prompt tokens, alone; nothing sampled yet.
    assert step() == ([0], [10], [10])
    assert seqs[0].output_token_ids == [] and cache.num_tokens(0, "target") == 10
    # Its last 2 prompt tokens (it samples now), then two 4-token prefills fill the budget; the fourth waits.
    assert step() == ([0, 1, 2], [2, 4, 4], [2, 4, 4])
    assert seqs[0].output_token_ids == [7] and seqs[3].status is SequenceStatus.WAITING
    # Three decodes first, then the fourth prompt.
    assert step() == ([0, 1, 2, 3], [1, 1, 1, 4], [1, 1, 1, 4])

    # A prompt longer than the budget left beside decodes runs in chunks of what is left, decodes first
    # whatever the admission order.
    long = _seq(4, 25)
    scheduler.add(long)
    assert step() == ([0, 1, 2, 3, 4], [1, 1, 1, 1, 6], [1, 1, 1, 1, 6])
    scheduler.running.reverse()  # the chunked prompt ahead of the decodes in admission order
    assert step() == ([3, 2, 1, 0, 4], [1, 1, 1, 1, 6], [1, 1, 1, 1, 6])
    assert step() == ([3, 2, 1, 0, 4], [1, 1, 1, 1, 6], [1, 1, 1, 1, 6])
    assert long.output_token_ids == [] and cache.num_tokens(4, "target") == 18
    assert step() == ([3, 2, 1, 0, 4], [1, 1, 1, 1, 6], [1, 1, 1, 1, 6])
    assert long.output_token_ids == [] and cache.num_tokens(4, "target") == 24
    # Its last prompt token is one row like a decode's, in running order; now it samples.
    assert step() == ([4, 3, 2, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1])
    assert long.output_token_ids == [7] and cache.num_tokens(4, "target") == 25


def test_preempts_the_newest_request_and_recomputes_it_later():
    # 24 tokens of pages (6 blocks of 4): two requests of 8-token prompts fill 4 blocks; growing
    # to 8 + 8 generated tokens each cannot last.
    cache = _cache(24)
    scheduler = Scheduler()
    scheduler.bind(cache, "target")
    a, b = _seq(0, 8, max_tokens=9), _seq(1, 8, max_tokens=9)
    scheduler.add(a)
    scheduler.add(b)
    preempted_at = None
    for step in range(40):
        batch = _run_step(scheduler, cache)
        if batch.preempted and preempted_at is None:
            preempted_at = step
            assert batch.preempted == [b]  # the newest goes
            assert cache.num_tokens(b.seq_id, "target") == 0
            assert scheduler.waiting[0] is b and b.status is SequenceStatus.WAITING
        if not scheduler.has_unfinished():
            break
    assert preempted_at is not None and scheduler.num_preemptions >= 1
    assert a.is_finished and b.is_finished
    assert a.output_token_ids == b.output_token_ids == [7] * 9
    assert cache.requests() == [] and cache.num_free_blocks("target") == 6


def test_reserves_drafts_in_every_pool():
    cache = _cache(40, pools=(("target", 4), ("draft", 3)))
    scheduler = Scheduler()
    scheduler.bind(cache, "target", num_lookahead=5)
    seqs = [_seq(i, 10, max_tokens=20) for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    batch = scheduler.schedule()
    # Each needs 10 + 5 tokens in both pools: 4 of the target's 10 blocks, 5 of the draft's 13.
    assert [s.seq_id for s in batch.seqs] == [0, 1] and batch.max_drafts == [5, 5]
    for s in batch.seqs:
        cache.append_slots(s.seq_id, 15)  # every pool, all or nothing: must fit


class PlantedMatches:
    """A prefix cache whose match is planted: ``drafting`` for a request keeping draft state, ``target_only``
    for one that keeps none (matched on the target's pools alone)."""

    def __init__(self, drafting: PrefixMatch, target_only: PrefixMatch):
        self.drafting, self.target_only = drafting, target_only

    def match(self, seq, max_recompute=math.inf, *, drafting=True):
        return self.drafting if drafting else self.target_only


@pytest.mark.parametrize("tokens,dormant,taken", [(40, True, "target_only"), (20, True, "drafting"),
                                                  (40, False, "drafting")])
def test_a_request_starting_dormant_is_matched_again_where_its_pages_fit(tokens, dormant, taken):
    cache = _cache(tokens)
    cache.append_slots("old", 16)  # four pages published, then freed: cached, evictable
    keys = [bytes([i]) * 16 for i in range(4)]
    cache.publish("old", "target", keys)
    cache.free("old")
    blocks = tuple(cache.lookup("target", keys))
    # Drafting, it reuses one page (its draft's pages end there); dormant, all four.
    matches = {"drafting": PrefixMatch(4, {"target": blocks[:1]}), "target_only": PrefixMatch(16, {"target": blocks})}
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8))  # the drafting match prefills in chunks
    scheduler.bind(cache, "target", num_lookahead=3, prefix=PlantedMatches(**matches),
                   dormant=lambda requests: set(requests) if dormant else set())
    seq = _seq(0, 20)
    scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.reuse[0] is matches[taken]
    # Dormant with room: the last 4 prompt tokens and 3 drafts (6 pages, the 4 cached ones taken off the
    # free list: the small cache's 5 cannot hold them). Otherwise a chunk of 8 after the page reused.
    assert (batch.num_new_tokens, batch.max_drafts) == (([4], [3]) if taken == "target_only" else ([8], [0]))
    cache.adopt(0, "target", batch.reuse[0].blocks["target"])
    cache.append_slots(0, batch.num_new_tokens[0] + batch.max_drafts[0])  # reserved: must fit


def test_sequence_stops_and_draft_caps():
    seq = Sequence(0, [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[9]), seed=0,
                   eos_token_ids=[2], max_model_len=8)
    assert seq.max_len == 8 and seq.max_drafts(10) == 5 and seq.max_kv_tokens() == 7
    assert seq.append([5, 2, 6]) == 2 and seq.finish_reason == "stop"  # EOS kept, the rest dropped
    seq = Sequence(0, [1], SamplingParams(max_tokens=3, ignore_eos=True), seed=0, eos_token_ids=[2], max_model_len=99)
    assert seq.append([2, 2, 2, 2]) == 3 and seq.finish_reason == "length" and seq.output_token_ids == [2, 2, 2]


def test_build_engine_from_parts_example_runs(tiny_checkpoint, capsys):
    example = Path(__file__).resolve().parents[2] / "examples" / "build_engine_from_parts.py"
    runpy.run_path(str(example))["main"](str(tiny_checkpoint("llama")))
    out = capsys.readouterr().out
    assert out.count(" length [") == 3 and "spec_stats:" in out


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_scheduler_config_is_validated(bad):
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=bad)


def test_an_interrupted_generate_leaves_nothing_behind(tiny_checkpoint):
    from specdec.backends import get_backend
    from specdec.engine import LLMEngine
    from specdec.models import load_model

    engine = LLMEngine(load_model(str(tiny_checkpoint("llama"))), PagedKVCache(1 << 20), get_backend("torch"))
    original, calls = engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original()

    engine.step = interrupted_step
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        engine.generate([[1, 2], [3, 4, 5]], [params, params])
    assert not engine.has_unfinished() and engine.cache.requests() == []
    engine.step = original
    out = engine.generate([[1, 2]], [params])
    assert len(out[0].output_token_ids) == 10
