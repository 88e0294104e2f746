"""``PagedKVCache.slots`` (the one slot formula) and ``scratch`` (transient rows that never outlive it)."""

import pytest
import torch

from specdec.cache import AttentionPool, KVCacheError, PagedKVCache


def _cache(block=4, tokens=64):
    cache = PagedKVCache(memory_budget=tokens * 16 * 2)
    for name in ("target", "draft"):
        cache.register(AttentionPool(name, num_layers=1, block_size=block, num_kv_heads=1, head_dim=1,
                                     dtype=torch.float64))
    cache.build()
    return cache


def test_slots_follow_the_block_table_from_the_sequence_start():
    cache = _cache()
    cache.append_slots("a", 3)
    appended = cache.append_slots("b", 6)["target"]
    assert cache.slots("b", "target", 0, 6).tolist() == appended.tolist()
    table = cache.block_table("b", "target")
    assert cache.slots("b", "target", 2, 6).tolist() == [table[p // 4] * 4 + p % 4 for p in range(2, 6)]
    cache.set_start("c", 10, ["draft"])
    got = cache.append_slots("c", 5, ["draft"])["draft"]
    assert cache.slots("c", "draft", 10, 15).tolist() == got.tolist()
    first = cache.block_table("c", "draft")[0]
    assert cache.slots("c", "draft", 11, 12).tolist() == [first * 4 + 1]  # pages indexed from the start
    for start, end in ((9, 12), (12, 16)):
        with pytest.raises(KVCacheError, match="holds positions 10..14"):
            cache.slots("c", "draft", start, end)


def test_scratch_restores_every_length_and_frees_its_pages():
    cache = _cache()
    cache.append_slots("a", 5)
    free = {name: cache.num_free_blocks(name) for name in ("target", "draft")}
    with cache.scratch(["a", "b"], ["draft"]):
        cache.append_slots("a", 7, ["draft"])
        cache.append_slots("b", 2, ["draft"])
        assert cache.num_tokens("a", "draft") == 12
    assert [cache.num_tokens(r, "draft") for r in ("a", "b")] == [5, 0]
    assert {name: cache.num_free_blocks(name) for name in ("target", "draft")} == free
    assert cache.num_tokens("a", "target") == 5  # pools outside the scope are untouched


def test_scratch_restores_on_an_error_too():
    cache = _cache()
    cache.append_slots("a", 2)
    with pytest.raises(RuntimeError), cache.scratch(["a"], ["target", "draft"]):
        cache.append_slots("a", 9)
        raise RuntimeError("a failed draft forward")
    assert cache.num_tokens("a", "target") == cache.num_tokens("a", "draft") == 2
    assert cache.blocks_held("a", "target") == 1
