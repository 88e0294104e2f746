"""Allocator throughput, prefix-caching costs and page-padding waste of the composable cache.

Prints allocator operations per second (raw allocate/free and the cache's append/truncate/free
path); the prefix cache's costs: hashing a page's key (chained BLAKE2b, ``PageKeyChain``) in
microseconds per page at pages of 16, 64 and 128 tokens, and the allocator's content-keyed operations
per second (publish, lookup hit and miss, acquire of a freed cached page, free into the evictable set,
allocate evicting the least recently freed); then, for a mixed-length workload in pools of page 16
and page 128, the bytes reserved but unused because a request's last page is partly empty.

    python benchmarks/bench_cache.py [--requests 2000] [--seed 0] [--hash-tokens 262144]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from specdec.cache import AttentionPool, BlockAllocator, PagedKVCache
from specdec.cache.page_keys import PageKeyChain


def allocator_ops_per_second(num_blocks: int = 100_000, rounds: int = 5) -> float:
    alloc = BlockAllocator(num_blocks)
    start = time.perf_counter()
    for _ in range(rounds):
        blocks = [alloc.allocate() for _ in range(num_blocks)]
        for b in blocks:
            alloc.free(b)
    return 2 * num_blocks * rounds / (time.perf_counter() - start)


def cache_ops_per_second(num_requests: int, rng: random.Random) -> float:
    cache = PagedKVCache(1 << 30)
    for name, size in (("target", 128), ("draft", 16)):
        cache.register(AttentionPool(name, num_layers=1, block_size=size, num_kv_heads=1, head_dim=8,
                                     dtype=torch.float16))
    cache.build()
    ops = 0
    start = time.perf_counter()
    for r in range(num_requests):
        cache.append_slots(r, rng.randint(16, 512))
        for _ in range(8):  # decode steps with 3 drafts, 1-4 kept
            length = cache.num_tokens(r, "target")
            cache.append_slots(r, 4)
            cache.truncate(r, length + rng.randint(1, 4))
            ops += 2
        cache.free(r)
        ops += 2
    return ops / (time.perf_counter() - start)


def hashing_us_per_page(block_size: int, tokens: list[int], repeats: int = 3) -> float:
    """Microseconds to key one page of ``block_size`` tokens, chaining through ``tokens`` (best of ``repeats``)."""
    num_pages = len(tokens) // block_size
    best = float("inf")
    for _ in range(repeats):
        chain = PageKeyChain(block_size)
        start = time.perf_counter()
        chain.extend(tokens, num_pages)
        best = min(best, time.perf_counter() - start)
    return best / num_pages * 1e6


def _rate(action, items) -> float:
    start = time.perf_counter()
    for item in items:
        action(item)
    return len(items) / (time.perf_counter() - start)


def prefix_ops_per_second(num_blocks: int = 100_000) -> dict[str, float]:
    """The allocator's content-keyed operations per second, each over ``num_blocks`` blocks: a full pool
    published, freed (kept findable), found, revived, freed again, then reallocated by eviction."""
    alloc = BlockAllocator(num_blocks)
    keys, absent = PageKeyChain(1), PageKeyChain(2)  # real page keys: 16-byte digests
    keys.extend(range(num_blocks), num_blocks)
    absent.extend(range(2 * num_blocks), num_blocks)
    keys, absent = keys.keys, absent.keys
    blocks = [alloc.allocate() for _ in range(num_blocks)]
    rates = {"publish": _rate(lambda i: alloc.publish(blocks[i], keys[i]), range(num_blocks)),
             "free (stays cached)": _rate(alloc.free, blocks),
             "lookup (hit)": _rate(alloc.lookup, keys),
             "lookup (miss)": _rate(alloc.lookup, absent)}
    found = [alloc.lookup(k) for k in keys]
    rates["acquire (revive a freed page)"] = _rate(alloc.acquire, found)
    for b in found:
        alloc.free(b)
    rates["allocate (evict oldest)"] = _rate(lambda _: alloc.allocate(), range(num_blocks))
    assert alloc.num_evictions == num_blocks and alloc.num_cached == 0
    return rates


def padding_waste(num_requests: int, rng: random.Random) -> list[tuple[str, int, int, int, float]]:
    # One MHA layer of 8 KV heads x 128 in bf16: 4 KiB per token, a realistic per-layer cost.
    pools = {
        "page16": AttentionPool("page16", num_layers=1, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
        "page128": AttentionPool("page128", num_layers=1, block_size=128, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
    }
    cache = PagedKVCache(1 << 36, device="meta")
    for pool in pools.values():
        cache.register(pool)
    cache.build()
    lengths = [rng.choice([rng.randint(1, 64), rng.randint(64, 1024), rng.randint(1024, 8192)]) for _ in range(num_requests)]
    for r, n in enumerate(lengths):
        cache.append_slots(r, n)
    rows = []
    for name, pool in pools.items():
        used_tokens = sum(lengths)
        reserved_tokens = sum(len(cache.block_table(r, name)) * pool.block_size for r in range(num_requests))
        per_token = pool.bytes_per_token()
        wasted = (reserved_tokens - used_tokens) * per_token
        rows.append((name, used_tokens * per_token, reserved_tokens * per_token, wasted, wasted / (reserved_tokens * per_token)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hash-tokens", type=int, default=1 << 18, help="length of the token list hashed")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(f"BlockAllocator allocate+free:        {allocator_ops_per_second() / 1e6:8.2f} M ops/s")
    print(f"PagedKVCache append/truncate/free:   {cache_ops_per_second(args.requests, rng) / 1e3:8.1f} K ops/s"
          " (two pools: page 128 + page 16)")
    print()
    tokens = [rng.randrange(1 << 17) for _ in range(args.hash_tokens)]
    print(f"page keys (chained BLAKE2b-128) over {args.hash_tokens} random token ids:")
    for size in (16, 64, 128):
        us = hashing_us_per_page(size, tokens)
        print(f"  page {size:<4} {us:8.2f} us/page {1e3 * us / size:8.1f} ns/token")
    print()
    print("BlockAllocator prefix-cache operations (100000 blocks):")
    for name, rate in prefix_ops_per_second().items():
        print(f"  {name:<32}{rate / 1e6:8.2f} M ops/s")
    print()
    print(f"page padding, {args.requests} requests of mixed length (1-64 / 64-1024 / 1024-8192 tokens):")
    print(f"{'pool':<10}{'used MiB':>12}{'reserved MiB':>14}{'wasted MiB':>12}{'wasted %':>10}")
    for name, used, reserved, wasted, share in padding_waste(args.requests, rng):
        print(f"{name:<10}{used / 2**20:12.1f}{reserved / 2**20:14.1f}{wasted / 2**20:12.1f}{100 * share:9.2f}%")


if __name__ == "__main__":
    main()
