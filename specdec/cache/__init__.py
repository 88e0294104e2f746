"""Composable paged KV cache: pools of different layouts and page sizes under one budget."""

from specdec.cache.allocator import BlockAllocator, BlockAllocatorError
from specdec.cache.paged_cache import KVCacheError, OutOfBlocksError, PagedKVCache, RequestTooLargeError
from specdec.cache.pool import AttentionPool, KVPool, MLAPool, PagedPool

__all__ = [
    "AttentionPool",
    "BlockAllocator",
    "BlockAllocatorError",
    "KVCacheError",
    "KVPool",
    "MLAPool",
    "OutOfBlocksError",
    "PagedKVCache",
    "PagedPool",
    "RequestTooLargeError",
]
