import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.cache import (
    AttentionPool,
    KVCacheError,
    MLAPool,
    OutOfBlocksError,
    PagedKVCache,
    PagedPool,
    RequestTooLargeError,
)

MiB = 1 << 20


def mla_target(block_size=1, layers=4):
    return MLAPool("target", num_layers=layers, block_size=block_size, kv_lora_rank=64, qk_rope_head_dim=16,
                   dtype=torch.bfloat16)


def mha_draft(block_size=16):
    return AttentionPool("draft", num_layers=1, block_size=block_size, num_kv_heads=2, head_dim=32,
                         dtype=torch.bfloat16)


def test_pool_layouts_and_per_token_cost():
    mla, mha = mla_target(), mha_draft()
    assert mla.bytes_per_token() == 4 * (64 + 16) * 2
    assert mha.bytes_per_token() == 1 * 2 * (2 * 32) * 2
    cache = PagedKVCache(MiB)
    cache.register(mla)
    cache.register(mha)
    cache.build()
    assert mla.layer(3)["latent"].shape == (mla.num_blocks, 1, 80)
    assert mha.layer(0)["k"].shape == (mha.num_blocks, 16, 2, 32)
    assert mha.layer(0)["v"].shape == (mha.num_blocks, 16, 2, 32)


def test_budget_split_by_per_token_cost_never_exceeds_budget():
    cache = PagedKVCache(3 * MiB + 12345)
    target = cache.register(mla_target(block_size=64))
    draft = cache.register(mha_draft(block_size=16))
    capacity = cache.build()
    assert cache.allocated_bytes() <= cache.memory_budget
    tokens = cache.memory_budget // (target.bytes_per_token() + draft.bytes_per_token())
    assert capacity == {"target": tokens // 64 * 64, "draft": tokens // 16 * 16}
    # The split is tight: one more block per pool would not fit.
    assert cache.allocated_bytes() + target.bytes_per_block() + draft.bytes_per_block() > cache.memory_budget


def test_mla_target_and_mha_draft_at_different_page_sizes_in_one_request():
    cache = PagedKVCache(4 * MiB)
    cache.register(mla_target(block_size=1))
    cache.register(mha_draft(block_size=16))
    cache.build()
    slots = cache.append_slots("r", 20)
    assert slots["target"].shape == (20,) and slots["draft"].shape == (20,)
    assert len(cache.block_table("r", "target")) == 20
    assert len(cache.block_table("r", "draft")) == 2
    # Slots follow each pool's own pages: position p -> table[p // bs] * bs + p % bs.
    table = cache.block_table("r", "draft")
    assert slots["draft"].tolist() == [table[p // 16] * 16 + p % 16 for p in range(20)]
    # Rollback of 5 rejected drafts: the draft pool drops its now-empty second page.
    cache.truncate("r", 15)
    assert len(cache.block_table("r", "target")) == 15
    assert len(cache.block_table("r", "draft")) == 1
    assert cache.num_tokens("r", "draft") == 15
    more = cache.append_slots("r", 3)
    assert more["draft"].tolist()[0] == table[0] * 16 + 15
    cache.free("r")
    assert cache.num_free_blocks("target") == cache.pool("target").num_blocks
    assert cache.num_free_blocks("draft") == cache.pool("draft").num_blocks


def test_pools_with_1_16_64_and_128_token_pages_coexist():
    cache = PagedKVCache(8 * MiB)
    for size in (1, 16, 64, 128):
        cache.register(AttentionPool(f"p{size}", num_layers=1, block_size=size, num_kv_heads=1, head_dim=8,
                                     dtype=torch.float32))
    cache.build()
    cache.append_slots("a", 130)
    assert {size: len(cache.block_table("a", f"p{size}")) for size in (1, 16, 64, 128)} == {
        1: 130, 16: 9, 64: 3, 128: 2}


def test_per_pool_lengths_can_differ():
    cache = PagedKVCache(MiB)
    cache.register(mla_target(block_size=16))
    cache.register(mha_draft(block_size=16))
    cache.build()
    cache.append_slots("r", 10)
    cache.append_slots("r", 3, pools=["target"])
    assert cache.num_tokens("r", "target") == 13 and cache.num_tokens("r", "draft") == 10
    cache.truncate("r", 10, pools=["target"])
    assert cache.num_tokens("r", "target") == 10


def test_out_of_blocks_is_all_or_nothing():
    cache = PagedKVCache(MiB)
    target = cache.register(mla_target(block_size=16))
    cache.register(mha_draft(block_size=16))
    cache.build()
    free_before = {name: cache.num_free_blocks(name) for name in ("target", "draft")}
    cache.append_slots("big", target.num_blocks * 16 - 16)
    assert not cache.can_admit("other", 32)
    with pytest.raises(OutOfBlocksError):
        cache.append_slots("other", 32)
    assert cache.num_tokens("other", "target") == 0
    cache.free("big")
    assert {name: cache.num_free_blocks(name) for name in ("target", "draft")} == free_before


def test_request_that_can_never_fit_gets_a_clear_error():
    cache = PagedKVCache(64 * 1024)
    cache.register(mla_target(block_size=16))
    cache.build()
    capacity = cache.capacity()["target"]
    cache.check_fits(capacity)
    with pytest.raises(RequestTooLargeError, match=r"raise kv_cache_memory to at least \d+ bytes"):
        cache.check_fits(capacity + 1)
    with pytest.raises(RequestTooLargeError):
        cache.append_slots("r", capacity + 1)
    needed = cache.bytes_needed(capacity + 1)
    bigger = PagedKVCache(needed)
    bigger.register(mla_target(block_size=16))
    bigger.build()
    bigger.check_fits(capacity + 1)


def test_misuse_is_reported():
    cache = PagedKVCache(MiB)
    cache.register(mha_draft())
    with pytest.raises(KVCacheError, match="already registered"):
        cache.register(mha_draft())
    with pytest.raises(KVCacheError, match="not built"):
        cache.append_slots("r", 1)
    cache.build()
    with pytest.raises(KVCacheError, match="already built"):
        cache.register(mla_target())
    with pytest.raises(KeyError, match="no pool named 'nope'"):
        cache.append_slots("r", 1, pools=["nope"])
    cache.append_slots("r", 4)
    with pytest.raises(KVCacheError, match="cannot truncate"):
        cache.truncate("r", 5)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        PagedKVCache(0)


def test_extra_layers_and_custom_entries():
    target = mla_target(layers=3)
    assert list(target.add_layers(1)) == [3]
    index = PagedPool("target.index", num_layers=2, block_size=128, dtype=torch.float32, entries={"index_k": (4, 8)})
    cache = PagedKVCache(MiB)
    cache.register(target)
    cache.register(index)
    cache.build()
    assert target.num_layers == 4
    assert index.layer(1)["index_k"].shape[1:] == (128, 4, 8)
    with pytest.raises(RuntimeError, match="already materialised"):
        target.add_layers(1)


def test_block_tables_are_padded_rows():
    cache = PagedKVCache(MiB)
    cache.register(mha_draft(block_size=4))
    cache.build()
    cache.append_slots("a", 9)
    cache.append_slots("b", 2)
    table = cache.block_tables(["a", "b", "never"], "draft")
    assert table.dtype == torch.int32 and table.shape == (3, 3)
    assert table[0].tolist() == cache.block_table("a", "draft")
    assert table[1, 0].item() == cache.block_table("b", "draft")[0]


actions = st.lists(
    st.tuples(st.sampled_from(["append", "truncate", "free"]), st.integers(0, 3), st.integers(0, 40)),
    max_size=60,
)


@settings(max_examples=100, deadline=None)
@given(actions=actions)
def test_random_append_truncate_free_keeps_pages_consistent(actions):
    cache = PagedKVCache(200_000)
    sizes = {"p1": 1, "p16": 16, "p128": 128}
    for name, size in sizes.items():
        cache.register(AttentionPool(name, num_layers=1, block_size=size, num_kv_heads=1, head_dim=4,
                                     dtype=torch.float32))
    cache.build()
    lengths: dict[int, int] = {}
    for action, req, amount in actions:
        if action == "append":
            new_len = lengths.get(req, 0) + amount
            if cache.can_admit(req, new_len):
                cache.append_slots(req, amount)
                lengths[req] = new_len
            else:
                with pytest.raises(KVCacheError):
                    cache.append_slots(req, amount)
        elif action == "truncate" and req in lengths:
            new_len = min(amount, lengths[req])
            cache.truncate(req, new_len)
            lengths[req] = new_len
        elif action == "free":
            cache.free(req)
            lengths.pop(req, None)
        for name, size in sizes.items():
            tables = [cache.block_table(r, name) for r in lengths]
            owned = [b for t in tables for b in t]
            assert len(owned) == len(set(owned)), "a page belongs to two requests"
            for r, table in zip(lengths, tables):
                assert len(table) == math.ceil(lengths[r] / size)
                assert cache.num_tokens(r, name) == lengths[r]
            assert cache.num_free_blocks(name) == cache.pool(name).num_blocks - len(owned)
