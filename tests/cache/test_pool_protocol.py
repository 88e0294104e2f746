"""Every built-in pool implements the whole KVPool protocol, before and after it is materialised."""

from __future__ import annotations

import pytest
import torch

from protocol_members import conformance_problems, protocol_members, without
from specdec.cache import AttentionPool, KVPool, MLAPool, PagedKVCache, PagedPool


def built_in_pools() -> list[KVPool]:
    return [
        AttentionPool("attn", num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32),
        MLAPool("mla", num_layers=1, block_size=1, kv_lora_rank=16, qk_rope_head_dim=4, dtype=torch.bfloat16),
        PagedPool("index", num_layers=1, block_size=128, dtype=torch.float64, entries={"k": (16,)}),
    ]


@pytest.mark.parametrize("pool", built_in_pools(), ids=lambda p: p.kind)
def test_pool_implements_every_member(pool):
    assert conformance_problems(pool, KVPool) == []
    assert not pool.is_materialized and pool.num_blocks == 0
    pool.materialize(3)
    assert conformance_problems(pool, KVPool) == []
    assert pool.is_materialized and pool.num_blocks == 3
    assert all(t.shape[:2] == (3, pool.block_size) for t in pool.layer(0).values())


def test_the_cache_hands_back_the_pools_it_was_given():
    cache = PagedKVCache(1 << 20)
    pools = [cache.register(p) for p in built_in_pools()]
    assert [cache.pool(p.name) for p in pools] == pools == list(cache.pools.values())
    assert all(isinstance(p, KVPool) for p in pools)


@pytest.mark.parametrize("member", sorted(protocol_members(KVPool)))
def test_a_pool_lacking_any_member_fails_the_check(member):
    pool = built_in_pools()[0]
    assert conformance_problems(without(pool, KVPool, member), KVPool) == [f"{member} is missing"]
