"""Prefix-cached pages at the cache level: page keys, the allocator's published blocks, the paged
cache's read-only rule, and how far ``PrefixCaching.match`` lets a request reuse.

No model runs here: every test is bookkeeping over tiny pools, so the file takes seconds.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.cache import AttentionPool, BlockAllocator, BlockAllocatorError, KVCacheError, PagedKVCache
from specdec.cache.page_keys import PageKeyChain, page_key, successor_key
from specdec.engine.pools import EnginePools
from specdec.engine.prefix_caching import PrefixCaching
from specdec.proposers.base import ProposerPools
from specdec.runtime.sequence import Sequence
from specdec.sampling import SamplingParams


# ----------------------------------------------------------------------------- page keys
def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _keys(tokens, block_size, num_pages=None, successor=False):
    num_pages = len(tokens) // block_size if num_pages is None else num_pages
    return PageKeyChain(block_size).pool_keys(tokens, 0, num_pages, successor)


def test_equal_prefixes_give_equal_keys_and_the_first_differing_page_differs_onward():
    a = _tokens(30)
    b = a[:13] + [t + 1 for t in a[13:]]  # differs from token 13: page 3 of 4-token pages
    ka, kb = _keys(a, 4), _keys(b, 4)
    assert len(ka) == len(kb) == 7
    assert ka[:3] == kb[:3]
    assert all(x != y for x, y in zip(ka[3:], kb[3:]))


@pytest.mark.parametrize("page", range(6))
def test_changing_one_token_of_page_i_changes_keys_i_onward_only(page):
    bs = 4
    a = _tokens(6 * bs, seed=page)
    for offset in (0, bs - 1):
        b = list(a)
        b[page * bs + offset] += 1
        ka, kb = _keys(a, bs), _keys(b, bs)
        assert ka[:page] == kb[:page]
        assert all(x != y for x, y in zip(ka[page:], kb[page:]))


def test_a_key_depends_only_on_its_page_and_earlier_tokens():
    a = _tokens(19)
    # Tokens past the keyed pages (a partial last page, anything after) change nothing.
    assert _keys(a, 4, 4) == _keys(a[:16], 4) == _keys(a[:16] + [5, 6, 7], 4, 4)
    # Same tokens at another page size: other pages, other keys.
    assert _keys(a[:12], 3)[:1] != _keys(a[:12], 4)[:1]
    # The chain is the documented one: page_key(parent, page tokens).
    first = page_key(_keys(a, 4)[0], a[4:8])
    assert _keys(a, 4)[1] == first


def test_incremental_chain_equals_one_shot():
    a = _tokens(40)
    chain = PageKeyChain(5)
    for n in (0, 1, 3, 3, 8):
        chain.extend(a[: n * 5 + 2], n)
    assert chain.keys == _keys(a, 5, 8)
    assert chain.pool_keys(a, 2, 5, False) == _keys(a, 5, 8)[2:5]


def test_successor_keys_hash_the_token_after_the_page():
    bs = 4
    a = _tokens(13)
    plain = _keys(a, bs, 3)
    succ = _keys(a, bs, 3, successor=True)
    assert [successor_key(k, a[(i + 1) * bs]) for i, k in enumerate(plain)] == succ
    assert not set(plain) & set(succ)
    # Same pages, another token after page 1: page 1's successor key differs, page 0's does not
    # (its successor, token 4, is unchanged) and neither do the plain keys.
    b = list(a)
    b[8] += 1
    assert _keys(b, bs, 2) == plain[:2]
    sb = _keys(b, bs, 2, successor=True)
    assert sb[0] == succ[0] and sb[1] != succ[1]
    # The successor of the last keyed page must be known.
    with pytest.raises(ValueError, match="successor"):
        _keys(a[:12], bs, 3, successor=True)
    with pytest.raises(ValueError):
        PageKeyChain(bs).extend(a[:7], 2)


# ----------------------------------------------------------------------------- the allocator
def test_publish_lookup_acquire_and_lru_eviction_order():
    alloc = BlockAllocator(4)
    blocks = [alloc.allocate() for _ in range(4)]
    for b, key in zip(blocks, "abcd"):
        assert alloc.publish(b, key)
    assert [alloc.lookup(k) for k in "abcd"] == blocks and alloc.lookup("z") is None
    assert alloc.num_cached == 4 and alloc.num_free == 0
    # Freed in the order c, a, d: still findable, and counted as free.
    for b in (blocks[2], blocks[0], blocks[3]):
        alloc.free(b)
    assert alloc.num_free == 3 and alloc.lookup("a") == blocks[0]
    # Reviving a: it is referenced again and leaves the evictable ones.
    assert alloc.acquire(blocks[0]) == blocks[0] and alloc.refcount(blocks[0]) == 1
    assert alloc.num_free == 2
    # Evicted least recently freed first: c, then d; their keys go.
    assert alloc.allocate() == blocks[2]
    assert alloc.lookup("c") is None and alloc.num_evictions == 1
    alloc.free(blocks[0])  # a is now the most recently freed
    assert alloc.allocate() == blocks[3]
    assert alloc.allocate() == blocks[0]
    assert alloc.num_evictions == 3 and alloc.num_cached == 1  # only b (referenced throughout)
    assert alloc.lookup("b") == blocks[1]
    with pytest.raises(BlockAllocatorError, match="no free blocks"):
        alloc.allocate()


def test_never_published_free_blocks_go_before_any_eviction():
    alloc = BlockAllocator(3)
    a, b = alloc.allocate(), alloc.allocate()
    alloc.publish(a, "a")
    alloc.free(a)
    alloc.free(b)  # b has no key: plain free
    assert alloc.allocate() == b
    c = alloc.allocate()
    assert c not in (a, b) and alloc.num_evictions == 0 and alloc.lookup("a") == a
    assert alloc.allocate() == a and alloc.num_evictions == 1


def test_publish_refusals():
    alloc = BlockAllocator(3)
    a, b = alloc.allocate(), alloc.allocate()
    assert alloc.publish(a, "k")
    assert not alloc.publish(a, "other")  # a block keeps its first key
    assert not alloc.publish(b, "k")  # a key names one block: the first stays
    assert alloc.lookup("k") == a and not alloc.is_published(b)
    with pytest.raises(BlockAllocatorError):
        alloc.publish(2, "free block")  # never allocated
    with pytest.raises(BlockAllocatorError):
        alloc.acquire(b)  # holds no published content
    alloc.free(b)
    assert alloc.num_free == 2


# Ops on a model of the allocator: ("alloc",) | ("free", i) | ("share", i) | ("publish", i, key)
# | ("acquire", key), where i picks one of the references held and key one of a few names.
alloc_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc")),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("share"), st.integers(0, 1000)),
        st.tuples(st.just("publish"), st.integers(0, 1000), st.integers(0, 5)),
        st.tuples(st.just("acquire"), st.integers(0, 5)),
    ),
    max_size=150,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(0, 8), ops=alloc_ops)
def test_a_referenced_block_is_never_evicted_and_eviction_is_lru(num_blocks, ops):
    alloc = BlockAllocator(num_blocks)
    held: list[int] = []  # one entry per reference held
    key_of: dict[int, int] = {}
    evictable: list[int] = []  # published, unreferenced; least recently freed first
    evictions = 0
    for op in ops:
        if op[0] == "alloc":
            free_plain = num_blocks - len(set(held)) - len(evictable)
            if free_plain == 0 and not evictable:
                with pytest.raises(BlockAllocatorError):
                    alloc.allocate()
                continue
            block = alloc.allocate()
            assert block not in held, "a referenced block was handed out again"
            if free_plain == 0:
                assert block == evictable.pop(0), "not the least recently freed cached block"
                del key_of[block]
                evictions += 1
            else:
                assert block not in key_of, "a cached block was evicted while never-published ones were free"
            held.append(block)
        elif op[0] == "acquire":
            block = alloc.lookup(op[1])
            expected = next((b for b, k in key_of.items() if k == op[1]), None)
            assert block == expected
            if block is not None:
                alloc.acquire(block)
                if block in evictable:
                    evictable.remove(block)
                held.append(block)
        elif held:
            block = held[op[1] % len(held)]
            if op[0] == "free":
                alloc.free(block)
                held.remove(block)
                if block not in held and block in key_of:
                    evictable.append(block)
            elif op[0] == "share":
                alloc.share(block)
                held.append(block)
            else:
                fresh = block not in key_of and op[2] not in key_of.values()
                assert alloc.publish(block, op[2]) == fresh
                if fresh:
                    key_of[block] = op[2]
        assert alloc.num_free == num_blocks - len(set(held))
        assert alloc.num_evictions == evictions and alloc.num_cached == len(key_of)
        for block in range(num_blocks):
            assert alloc.refcount(block) == held.count(block)
        for block, key in key_of.items():
            assert alloc.lookup(key) == block and alloc.is_published(block)


# ----------------------------------------------------------------------------- the paged cache
def _cache(*pools: tuple[str, int], tokens: int = 48) -> PagedKVCache:
    """Pools of one layer, one head of dim 1, float64: each holds ``tokens`` tokens."""
    cache = PagedKVCache(memory_budget=tokens * 16 * len(pools))
    for name, block in pools:
        cache.register(AttentionPool(name, num_layers=1, block_size=block, num_kv_heads=1, head_dim=1,
                                     dtype=torch.float64))
    cache.build()
    return cache


def test_write_slots_refuses_shared_and_published_pages():
    cache = _cache(("target", 4))
    cache.append_slots("a", 10)  # pages 0, 1 full, page 2 half
    blocks = cache.block_table("a", "target")
    assert cache.write_slots("a", "target", 0, 10).tolist() == cache.slots("a", "target", 0, 10).tolist()
    cache.publish("a", "target", [b"k0"])
    with pytest.raises(KVCacheError, match="read-only"):
        cache.write_slots("a", "target", 3, 5)  # touches published page 0
    assert cache.write_slots("a", "target", 4, 10).numel() == 6  # pages 1, 2 are its own
    cache.allocator("target").share(blocks[2])  # someone else holds page 2
    with pytest.raises(KVCacheError, match="read-only"):
        cache.write_slots("a", "target", 9, 10)
    assert cache.write_slots("a", "target", 4, 8).numel() == 4
    # Another request adopting page 0 sees it as shared and published.
    cache.adopt("b", "target", [blocks[0]])
    with pytest.raises(KVCacheError, match="read-only"):
        cache.write_slots("b", "target", 0, 4)


def test_append_slots_refuses_to_fill_a_frozen_partial_page():
    cache = _cache(("target", 4))
    cache.append_slots("a", 6)
    page = cache.block_table("a", "target")[1]
    cache.allocator("target").share(page)
    with pytest.raises(KVCacheError, match="read-only"):
        cache.append_slots("a", 1)
    cache.allocator("target").free(page)
    cache.allocator("target").publish(page, b"half")
    with pytest.raises(KVCacheError, match="read-only"):
        cache.append_slots("a", 1)
    # A full frozen page is fine: the next token goes to a new page.
    cache.append_slots("b", 4)
    cache.publish("b", "target", [b"full"])
    assert cache.append_slots("b", 1)["target"].tolist()[0] // 4 != cache.block_table("b", "target")[0]


def test_append_slots_refusing_a_frozen_page_changes_no_pool():
    """All-or-nothing like a shortage of pages: a refusal in the second pool leaves the first untouched."""
    cache = _cache(("target", 4), ("draft", 3))
    cache.append_slots("a", 5)
    cache.allocator("draft").share(cache.block_table("a", "draft")[1])  # draft page 1 (positions 3..5) frozen
    free = {n: cache.num_free_blocks(n) for n in ("target", "draft")}
    with pytest.raises(KVCacheError, match="read-only"):
        cache.append_slots("a", 4)
    assert cache.num_tokens("a", "target") == 5 and cache.num_tokens("a", "draft") == 5
    assert {n: cache.num_free_blocks(n) for n in ("target", "draft")} == free


def test_adopt_publish_and_free():
    cache = _cache(("target", 4))
    cache.append_slots("a", 9)
    cache.publish("a", "target", [b"p0", b"p1"])
    with pytest.raises(KVCacheError, match="cannot publish"):
        cache.publish("a", "target", [b"p0", b"p1", b"p2"])  # page 2 is not full
    a0, a1, _ = cache.block_table("a", "target")
    assert cache.lookup("target", [b"p0", b"p1", b"zz", b"p1"]) == [a0, a1]
    cache.adopt("b", "target", [a0, a1])
    assert cache.num_tokens("b", "target") == 8 and cache.allocator("target").refcount(a0) == 2
    with pytest.raises(KVCacheError, match="already holds"):
        cache.adopt("b", "target", [a0])
    # Its next token goes to a page of its own.
    new = cache.append_slots("b", 1)["target"].item() // 4
    assert new not in (a0, a1) and cache.allocator("target").refcount(new) == 1
    assert cache.num_freeable("b", "target") == 1 and cache.num_freeable("a", "target") == 1
    cache.free("a")
    free_before = cache.num_free_blocks("target")
    cache.free("b")
    # The published pages stay findable (and count as free) after their last holder goes.
    assert cache.lookup("target", [b"p0", b"p1"]) == [a0, a1]
    assert cache.num_free_blocks("target") == free_before + 3
    assert cache.num_free_blocks("target") == cache.pool("target").num_blocks
    # num_evictable: adopting them takes them out of the free pages.
    assert cache.num_evictable("target", [a0, a1]) == 2


def test_eviction_drops_the_tail_of_a_freed_chain_first():
    """A request's pages are one chain: lookups stop at the first missing page, so evicting a chain's
    first page first throws away every page after it. Freed together, the tail must go first
    (vLLM frees a request's blocks in reverse for this)."""
    cache = _cache(("target", 4), tokens=16)  # 4 blocks
    cache.append_slots("a", 13)
    keys = [b"p0", b"p1", b"p2"]
    cache.publish("a", "target", keys)
    cache.free("a")  # 3 evictable cached pages, 1 never-published free one
    cache.append_slots("b", 8)  # 2 pages: the plain one, then one eviction
    assert cache.allocator("target").num_evictions == 1
    assert len(cache.lookup("target", keys)) == 2, "the head of the chain was evicted: the whole chain is lost"


# ----------------------------------------------------------------------------- PrefixCaching.match
def _seq(seq_id: int, tokens, **params) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=4, ignore_eos=True, **params), seed=0,
                    max_model_len=10_000, index=seq_id)


def _prefix(target=(("target", 4),), own=(("draft", 3),), lead=None, successor=False, tokens=240):
    cache = _cache(*target, *own, tokens=tokens)
    draft = ProposerPools(own=tuple(n for n, _ in own), reuse_lead=lead,
                          successor_keyed=tuple(n for n, _ in own) if successor else ())
    return cache, PrefixCaching(cache, EnginePools(tuple(n for n, _ in target), draft), None)


def _computed(cache, prefix, seq, lengths=None):
    """Fill ``seq``'s pools as the engine would (``lengths``: per pool, default its tokens), publish, free."""
    for name in cache.pools:
        n = (lengths or {}).get(name, seq.num_tokens)
        cache.append_slots(seq.seq_id, n, [name])
    prefix.publish(seq)
    cache.free(seq.seq_id)
    prefix.release(seq.seq_id)


def _reused(cache, match) -> tuple[int, int, int]:
    """(target positions reused, draft positions reused, target rows recomputed) of a match."""
    if match is None:
        return 0, 0, 0
    draft = len(match.blocks.get("draft", ())) * cache.pool("draft").block_size
    return match.num_cached_tokens, draft, match.num_recomputed


@settings(max_examples=150, deadline=None)
@given(first=st.integers(1, 60), second=st.integers(1, 60), common=st.integers(0, 60),
       lead=st.sampled_from([None, 0, 1]), max_recompute=st.sampled_from([0, 2, 5, math.inf]))
def test_match_reuses_whole_pages_of_every_pool_never_the_last_token(first, second, common, lead, max_recompute):
    """Request 0 (``first`` tokens) computed and published; request 1 (``second`` tokens, the first
    ``common`` equal) is matched. Each pool reuses whole pages, short of its last token, that request 0
    published (positions < first - 1); a successor-keyed page (lead 0: a shifted EAGLE3 draft) also
    needs the token after it to be equal. With a lead the target's forward must start ``lead`` short of
    the draft's reuse: it recomputes the reused rows past that (at most ``max_recompute``, else it
    reuses whole pages up to there only)."""
    common = min(common, first, second)
    base = _tokens(first, seed=1)
    other = base[:common] + [t + 1000 for t in _tokens(second, seed=2)[common:]]
    cache, prefix = _prefix(lead=lead, successor=lead == 0)
    _computed(cache, prefix, _seq(0, base))
    target, draft, recompute = _reused(cache, prefix.match(_seq(1, other), max_recompute))
    want_draft = max(0, min(common - (lead == 0), first - 1, second - 1)) // 3 * 3
    want_target = min(common, first - 1, second - 1) // 4 * 4
    want_recompute = 0
    if lead is not None:
        want_recompute = max(0, min(want_target, want_target - want_draft + lead))
        if want_recompute > max_recompute:
            want_target, want_recompute = max(0, min(want_target, want_draft - lead)) // 4 * 4, 0
    assert (target, draft, recompute) == (want_target, want_draft, want_recompute)
    assert target % 4 == 0 and draft % 3 == 0 and target < second and draft < second
    if lead is not None:  # the forward starts where the draft still has states to catch up
        assert target - recompute <= max(0, draft - lead)


def test_match_alignment_target_page_4_draft_page_3():
    base = _tokens(40)
    cache, prefix = _prefix(lead=0, successor=True)
    _computed(cache, prefix, _seq(0, base))
    # n: (target, draft, target rows recomputed); each pool stops short of the last token, a draft page
    # also needs its successor token, and the target recomputes where the draft's pages end first.
    want = {13: (12, 12, 0), 12: (8, 9, 0), 11: (8, 9, 0), 9: (8, 6, 2), 25: (24, 24, 0), 40: (36, 39, 0)}
    for n, expected in want.items():
        got = _reused(cache, prefix.match(_seq(n, base[:n])))
        assert got == expected, n
    # Without room to recompute: whole target pages up to the draft's reuse only.
    assert _reused(cache, prefix.match(_seq(9, base[:9]), 1)) == (4, 6, 0)


def test_target_pools_reuse_one_length_a_multiple_of_the_lcm():
    base = _tokens(60)
    cache, prefix = _prefix(target=(("target", 4), ("target_index", 6)), own=())
    _computed(cache, prefix, _seq(0, base))
    for n in range(2, 61):
        match = prefix.match(_seq(n, base[:n]))
        want = (n - 1) // 12 * 12
        if want == 0:
            assert match is None
            continue
        assert match.num_cached_tokens == want
        assert {k: len(v) for k, v in match.blocks.items()} == {"target": want // 4, "target_index": want // 6}


def test_match_is_limited_by_what_the_first_request_published():
    base = _tokens(30)
    cache, prefix = _prefix(lead=1)
    # Its draft rows trail: 17 of the draft pool's positions, all 30 of the target's.
    _computed(cache, prefix, _seq(0, base), {"target": 30, "draft": 17})
    # Draft pages 0..4 (positions < 15) were final; the target's 28 are reused, its forward starts at
    # 15 - lead = 14 (recomputing 14 rows), or with less room whole pages up to there only.
    assert _reused(cache, prefix.match(_seq(1, base))) == (28, 15, 14)
    assert _reused(cache, prefix.match(_seq(1, base), 13)) == (12, 15, 0)


def test_no_reuse_with_prompt_logprobs_or_when_disabled():
    base = _tokens(20)
    cache, prefix = _prefix()
    _computed(cache, prefix, _seq(0, base))
    assert prefix.match(_seq(1, base)) is not None
    assert prefix.match(_seq(2, base, prompt_logprobs=1)) is None
    prefix.enabled = False
    assert prefix.match(_seq(3, base)) is None


def test_admit_adopts_and_counts():
    base = _tokens(20)
    cache, prefix = _prefix(lead=0, successor=True)
    _computed(cache, prefix, _seq(0, base))
    seq = _seq(1, base[:18] + [7, 7])
    match = prefix.match(seq)
    prefix.admit(seq, match)
    # Draft page 5 (positions 15..17) is keyed with token 18, which differs: 15 draft positions, so the
    # target reuses 16 and recomputes its row 15.
    assert _reused(cache, match) == (16, 15, 1)
    assert prefix.stats.queries == 20 and prefix.stats.hits == 16 and prefix.stats.recomputed == 1
    assert cache.num_tokens(1, "target") == 16 and cache.num_tokens(1, "draft") == 15
    for name, blocks in match.blocks.items():
        assert cache.block_table(1, name) == list(blocks)
        assert all(cache.allocator(name).refcount(b) == 1 for b in blocks)
    assert math.isclose(prefix.stats.hit_rate, 16 / 20)
