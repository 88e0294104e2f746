"""Prefix caching is exact: with it on, every proposer gives what it gives with it off, and what the
plain (non-speculative) target gives, token for token, in float64.

The workload (prefix_workload.py) shares long prefixes within a generate call, across calls on the same
``LLM`` (pages published by earlier requests) and across the turns of a conversation (turn 2 = turn 1's
prompt + its answer + new tokens). Checked for every proposer on a Llama target, and for ``ngram`` +
``eagle3`` (+ ``eagle3.1-mla`` in the target's MLA pool) on DeepSeek-V3 and MiniMax-M3 (128-token
pages):

- greedy outputs equal with caching on, off, and without speculation; every request's drafts and
  accepted counts are equal on and off (a stale draft page would change them, not the output); the
  target's and the drafts' own pools really start requests from cached pages, and the hits are the
  plain engine's;
- seeded sampled outputs equal on and off;
- under memory pressure (requests preempted, cached pages evicted), outputs still equal;
- a published or shared page never changes while it is published or shared, nor a cached page while a
  request holds it (checked after every step against a snapshot of its KV);
- no forward writes a KV slot twice or into a cached page (rows the target recomputes for a draft's
  hidden states write scratch slots);
- a request asking for prompt logprobs reuses nothing and gets the same logprobs;
- under the adaptive controller, requests starting dormant reuse the target's pages as a plain request
  does (no recompute for a draft's hidden states; in a joined MLA pool, pages published for the
  target's rows alone), and drafting requests beside them draft as without caching.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from prefix_workload import (
    CACHED_DRAFT_POOLS,
    CASES,
    GREEDY,
    K,
    MAX_TOKENS,
    build_models,
    bytes_per_token,
    make_llm,
    record_reuse,
    rounds,
    run_workload,
)

from specdec import SamplingParams
from specdec.engine.goodput import MIN_EVIDENCE, MIN_TIMED_DRAFT_STEPS, GoodputController

SAMPLED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("prefix_caching"))


@pytest.fixture(scope="module")
def baseline(models):
    """Plain target, no speculation, no prefix caching: the workload's outputs per (target, params)."""
    done: dict = {}

    def get(target: str, params: SamplingParams = GREEDY):
        key = (target, params.temperature, params.seed)
        if key not in done:
            done[key] = run_workload(make_llm(models, target, "none", caching=False), params)[0]
        return done[key]

    return get


@pytest.fixture(scope="module")
def plain_hits(models):
    """Prefix-cache hits of the workload without speculation, per target."""
    done: dict = {}

    def get(target: str) -> int:
        if target not in done:
            llm = make_llm(models, target, "none")
            run_workload(llm)
            done[target] = llm.prefix_cache_stats()["hits"]
        return done[target]

    return get


def _draft_pools(llm) -> set[str]:
    return set(llm.engine.cache.pools) - set(llm.engine.pools.target)


@pytest.mark.parametrize("target,proposer", CASES)
def test_greedy_outputs_and_drafts_equal_with_caching_on_and_off(target, proposer, models, baseline, plain_hits):
    want = baseline(target)
    on = make_llm(models, target, proposer, caching=True)
    reused = record_reuse(on)
    outputs, traces = run_workload(on)
    assert outputs == want
    assert on.prefix_cache_stats()["hits"] > 0
    if proposer != "eagle3.1-mla":  # its draft rows share the target's pages: keyed with their successor
        # Speculation keeps the plain engine's reuse (recomputing rows the draft's pages lack).
        assert on.prefix_cache_stats()["hits"] == plain_hits(target)
    assert reused.get("target", 0) > 0
    if proposer in CACHED_DRAFT_POOLS:
        assert set(reused) & _draft_pools(on), f"the draft's pools {sorted(_draft_pools(on))} reused no page"
    if proposer == "none":
        return
    off = make_llm(models, target, proposer, caching=False)
    off_outputs, off_traces = run_workload(off)
    assert off_outputs == want
    assert off.prefix_cache_stats()["hits"] == 0
    # Same drafts, same accepted counts, request by request and step by step.
    assert traces == off_traces
    assert on.spec_stats().num_accepted_tokens > 0, "nothing accepted: the trace check would be vacuous"


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft_model", "eagle3", "eagle3-unshifted-own"])
def test_seeded_sampling_equal_with_caching_on_and_off(proposer, models, baseline):
    on = make_llm(models, "llama", proposer, caching=True)
    outputs, traces = run_workload(on, SAMPLED)
    off_outputs, off_traces = run_workload(make_llm(models, "llama", proposer, caching=False), SAMPLED)
    assert outputs == off_outputs and traces == off_traces
    assert on.prefix_cache_stats()["hits"] > 0
    assert outputs != baseline("llama"), "sampling gave the greedy tokens: the check would be vacuous"
    if proposer == "none":
        assert outputs == baseline("llama", SAMPLED)


def _pressure_memory(models, target, proposer) -> int:
    """Pages for the workload's longest request and one page more (three run at once)."""
    roomy = make_llm(models, target, proposer)
    longest = max(len(p) for batch in rounds(target) for p in batch) + 2 * MAX_TOKENS + 2 * K
    block = roomy.engine.cache.pool("target").block_size
    return bytes_per_token(roomy) * (-(-longest // block) + 1) * block


PRESSURE_CASES = [c for c in CASES if c[0] == "llama"] + [("deepseek", "eagle3.1-mla"), ("minimax", "eagle3")]


@pytest.mark.parametrize("target,proposer", PRESSURE_CASES)
def test_outputs_equal_when_requests_are_preempted_and_cached_pages_evicted(target, proposer, models, baseline):
    llm = make_llm(models, target, proposer, memory=_pressure_memory(models, target, proposer))
    outputs, _ = run_workload(llm)
    assert outputs == baseline(target)
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.cache.allocator("target").num_evictions > 0
    assert llm.prefix_cache_stats()["hits"] > 0


# ----------------------------------------------------------------------------- cached pages stay put
class PageWatch:
    """After every step: each page that is published (under the same key as before) or shared by
    several requests (since before) must hold the KV it held when it became so, in every layer; and
    every cached page a request holds (adopted or published by it) must keep its content for as long as
    the request holds it (a page evicted or handed out while a request reads it would change)."""

    def __init__(self, llm):
        self.cache = llm.engine.cache
        self.tracked: dict[tuple[str, int], tuple[object, list[torch.Tensor]]] = {}
        self.held: dict[tuple[object, str, int], tuple[int, list[torch.Tensor]]] = {}
        self.compared = {name: 0 for name in self.cache.pools}
        self.shared = {name: 0 for name in self.cache.pools}

    def _content(self, name: str, block: int) -> list[torch.Tensor]:
        pool = self.cache.pool(name)
        return [t[block].clone() for i in range(pool.num_layers) for t in pool.layer(i).values()]

    def _same(self, name: str, block: int, before: list[torch.Tensor], what: str) -> None:
        for old, now in zip(before, self._content(name, block)):
            assert torch.equal(old, now), f"page {block} of pool {name!r} changed while {what}"
        self.compared[name] += 1

    def __call__(self, _out) -> None:
        cache = self.cache
        for name in cache.pools:
            alloc = cache.allocator(name)
            keys = alloc._key_of  # block -> content key (the allocator's own record)
            for block in range(alloc.num_blocks):
                refs = alloc.refcount(block)
                if refs > 1:
                    self.shared[name] += 1
                tag = ("key", keys[block]) if block in keys else ("shared",) if refs > 1 else None
                seen = self.tracked.get((name, block))
                if seen is not None and seen[0] == tag:
                    self._same(name, block, seen[1], "published" if tag[0] == "key" else "shared")
                elif tag is None:
                    self.tracked.pop((name, block), None)
                else:
                    self.tracked[name, block] = (tag, self._content(name, block))
        requests = set(cache.requests())
        self.held = {k: v for k, v in self.held.items() if k[0] in requests}
        for request in requests:
            for name in cache.pools:
                table = cache.block_table(request, name)
                for page in range(cache.num_published(request, name)):
                    seen = self.held.get((request, name, page))
                    if seen is not None and seen[0] == table[page]:
                        self._same(name, table[page], seen[1], f"request {request!r} held it")
                    else:
                        self.held[request, name, page] = (table[page], self._content(name, table[page]))


@pytest.mark.parametrize("target,proposer,pressure", [
    ("llama", "eagle3", False),
    ("llama", "draft_model", False),
    ("llama", "eagle3-unshifted-own", False),
    ("deepseek", "eagle3.1-mla", False),
    ("llama", "eagle3", True),
])
def test_published_and_shared_pages_never_change(target, proposer, pressure, models, baseline):
    memory = _pressure_memory(models, target, proposer) if pressure else 1 << 23
    llm = make_llm(models, target, proposer, memory=memory, max_num_batched_tokens=7 if pressure else None)
    watch = PageWatch(llm)
    outputs, _ = run_workload(llm, on_step=watch)
    assert outputs == baseline(target)
    for name in llm.engine.cache.pools:  # every pool's pages were checked, and some were shared
        assert watch.compared[name] > 0 and watch.shared[name] > 0, (name, watch.compared, watch.shared)


class ForwardSlots:
    """Wraps the target's model runner: in every forward, the rows' KV must go to distinct slots, none in
    a page that is published or shared (a recomputed row's KV goes to scratch slots; those must not be
    another row's of the same forward, or which write lands depends on the backend's write order)."""

    def __init__(self, llm):
        self.cache = llm.engine.cache
        runner = llm.engine.runner
        self.primary, self.context = runner.pool_names[0], runner.context
        runner.context = self
        self.recomputed = 0

    def __call__(self, layout):
        cache = self.cache
        self.recomputed += sum(cache.num_tokens(r, self.primary) - s
                               for r, s in zip(layout.requests, layout.start_positions))
        ctx = self.context(layout)
        for name, meta in ctx.metadata.items():
            slots, bs, alloc = meta.slot_mapping.tolist(), cache.pool(name).block_size, cache.allocator(name)
            twice = sorted({s for s, n in Counter(slots).items() if n > 1})
            assert not twice, (
                f"pool {name!r}: slots {twice} are written twice in one forward (requests {layout.requests}, "
                f"starts {layout.start_positions}, rows {layout.query_lens}, slots {slots})"
            )
            frozen = sorted({s // bs for s in slots if alloc.refcount(s // bs) > 1 or alloc.is_published(s // bs)})
            assert not frozen, f"pool {name!r}: a forward writes into shared or published pages {frozen}"
        return ctx


def test_a_recomputed_row_never_writes_another_rows_kv_slot(models):
    """Smallest case: a shifted EAGLE3 draft (3-token pages) whose last cached page was computed for
    another successor, so the target (4-token pages) recomputes rows 9..11 of a 16-token prompt: their
    KV goes to the slots of positions 16..18, on a page the forward gives back; a prompt admitted in the
    same step then gets that page for its own rows."""
    base = rounds("llama")[0][0]
    prompt = base[:13]
    again = base[:12] + [(base[12] + 1) % 61 + 3, 5, 6, 7]  # token 12 differs: draft page 3's successor
    other = [9, 8, 7, 6, 5]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    plain = make_llm(models, "llama", "none", caching=False)
    want = [o.token_ids for o in plain.generate([again, other], params, use_tqdm=False)]
    llm = make_llm(models, "llama", "eagle3")
    watch = ForwardSlots(llm)
    llm.generate([prompt], params, use_tqdm=False)
    got = llm.generate([again, other], params, use_tqdm=False)
    assert watch.recomputed == 3
    assert [o.token_ids for o in got] == want


@pytest.mark.parametrize("target,proposer,pressure", [
    ("llama", "eagle3", False),
    ("llama", "eagle3-unshifted-own", False),
    ("deepseek", "eagle3", False),
    ("minimax", "eagle3", False),
    ("llama", "eagle3-unshifted-own", True),
])
def test_forwards_write_distinct_slots_outside_cached_pages(target, proposer, pressure, models, baseline):
    memory = _pressure_memory(models, target, proposer) if pressure else 1 << 23
    llm = make_llm(models, target, proposer, memory=memory, max_num_batched_tokens=7 if pressure else None)
    watch = ForwardSlots(llm)
    outputs, _ = run_workload(llm)
    assert outputs == baseline(target)
    assert watch.recomputed > 0, "no row was recomputed: the check would be vacuous"


def test_prefix_caching_is_on_by_default(models):
    from specdec import LLM

    assert LLM(str(models["llama"]), dtype="float64").engine.prefix.enabled
    assert not make_llm(models, "llama", "none", caching=False).engine.prefix.enabled


def test_prompt_logprobs_requests_reuse_nothing_and_match(models):
    prompts = rounds("llama")[0]
    params = SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=1, ignore_eos=True)

    def run(caching):
        llm = make_llm(models, "llama", "eagle3", caching=caching)
        llm.generate(prompts, GREEDY, use_tqdm=False)  # publishes the shared prefixes
        hits = llm.prefix_cache_stats()["hits"]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.prefix_cache_stats()["hits"] == hits
        return outs

    on, off = run(True), run(False)
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) > 0
        for x, y in zip(a.prompt_logprobs, b.prompt_logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-9


class NeverPays(GoodputController):
    """Admission finds that drafting never pays: every request starts dormant (no probe either: the
    rates are backed by drafts verified before, the draft's price by steps timed before)."""

    def __init__(self, k: int):
        super().__init__(k)
        for _ in range(2 * MIN_EVIDENCE):  # counts fade: more observations than the threshold
            self.acceptance.observe("before", k, 0)
        for _ in range(MIN_TIMED_DRAFT_STEPS):
            self.draft_seconds.observe(1, 1.0)

    def speculation_pays(self, num_requests: int, num_dormant: int = 0) -> bool:
        return False


class CoinPays(GoodputController):
    """Admission's answer is a seeded coin, so dormant and drafting requests share the cache; a
    request drafting gets every draft it may and none is woken, so that runs with caching on and off
    take the same steps (the controller's measured choices would not)."""

    def __init__(self, k: int):
        super().__init__(k)
        self._coin = random.Random(0)

    def speculation_pays(self, num_requests: int, num_dormant: int = 0) -> bool:
        return self._coin.random() < 0.5

    def best_counts(self, requests, caps, base_rows, *, probe=False):
        return list(caps)

    def to_wake(self, seqs):
        return []


@pytest.mark.parametrize("admission", [NeverPays, CoinPays], ids=["all-dormant", "mixed"])
@pytest.mark.parametrize("target,proposer", [("llama", "eagle3"), ("llama", "eagle3-unshifted-sharing"),
                                             ("llama", "draft_model"), ("minimax", "eagle3"),
                                             ("deepseek", "eagle3.1-mla")])
def test_requests_starting_dormant_reuse_the_target_s_pages_as_a_plain_request_does(
        target, proposer, admission, models, baseline, plain_hits):
    def run(caching: bool):
        llm = make_llm(models, target, proposer, adaptive=True, caching=caching)
        llm.engine.draft_counts = admission(K)
        reused = record_reuse(llm)
        return (llm, reused, *run_workload(llm))

    llm, reused, outputs, traces = run(True)
    assert outputs == baseline(target)
    stats = llm.engine.prefix_cache_stats()
    if proposer != "eagle3.1-mla":
        assert stats.hits == plain_hits(target)
    elif admission is NeverPays:
        # Its draft rows share the target's pages, keyed with their successor token: the hits of a
        # drafting engine (dormant requests publish those pages for the target's rows alone).
        drafting = make_llm(models, target, proposer)
        run_workload(drafting)
        assert stats.hits == drafting.prefix_cache_stats()["hits"] > 0
    if admission is NeverPays:
        assert llm.spec_stats().num_drafts == 0
        assert stats.recomputed == 0  # no reused row was run again for a draft's hidden states
        assert not set(reused) & _draft_pools(llm)
    else:
        assert llm.spec_stats().num_drafts > 0
        # The drafting requests' drafts are those of an engine without caching: none read a page
        # published for the target's rows alone (a joined pool's draft rows there are not final).
        assert traces == run(False)[3]
