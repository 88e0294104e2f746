"""Fixed-size block allocator with reference counts and content-keyed (prefix-cached) blocks."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class BlockAllocatorError(RuntimeError):
    """A block id was freed twice, never allocated, or does not belong to this allocator."""


class BlockAllocator:
    """Hands out block ids ``0..num_blocks-1`` in O(1), with reference counts and content keys.

    Reference counts let several owners (requests sharing a cached prefix) hold the same block; a block
    returns to the free pool when its last reference is dropped.

    A block may be *published* under a content key (:meth:`publish`: the chained hash of the tokens its
    page holds). A published block keeps its key after its last reference goes: it waits, still
    findable by :meth:`lookup`, among the *evictable* blocks, and :meth:`acquire` takes it back. Only
    when no never-published block is free does :meth:`allocate` evict one, least recently freed first,
    dropping its key. A block with a reference is never evicted, and a key names at most one block.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # Popping from the end is O(1); reversed so that fresh allocators hand out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # published, unreferenced; oldest first
        self._refcount: list[int] = [0] * num_blocks
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out now (evictable cached blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks carrying a content key, referenced or not."""
        return len(self._key_of)

    def allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.num_evictions += 1
        else:
            raise BlockAllocatorError("no free blocks left")
        self._refcount[block] = 1
        return block

    def share(self, block: int) -> int:
        """Add a reference to an allocated block and return it."""
        self._check_live(block, "share")
        self._refcount[block] += 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference; the block is reusable once no reference is left (a published one stays
        findable until it is evicted)."""
        self._check_live(block, "free")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcount[block]

    # ----- content keys -----
    def publish(self, block: int, key: Hashable) -> bool:
        """Give a referenced block the content key ``key``; False (nothing changes) when the block
        already has a key or another block holds ``key`` (a duplicate page: the first one stays)."""
        self._check_live(block, "publish")
        if block in self._key_of or key in self._block_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def lookup(self, key: Hashable) -> int | None:
        """The block published under ``key``, referenced or evictable; None if there is none."""
        return self._block_of.get(key)

    def acquire(self, block: int) -> int:
        """Take a reference to a published block found by :meth:`lookup` (reviving an evictable one)."""
        self._check_id(block)
        if block not in self._key_of:
            raise BlockAllocatorError(f"cannot acquire block {block}: it holds no published content")
        if self._refcount[block] == 0:
            del self._evictable[block]
        self._refcount[block] += 1
        return block

    def is_published(self, block: int) -> bool:
        return block in self._key_of

    def _check_id(self, block: int) -> None:
        if not (isinstance(block, int) and 0 <= block < self.num_blocks):
            raise BlockAllocatorError(
                f"block id {block!r} does not belong to this allocator (valid: 0..{self.num_blocks - 1})"
            )

    def _check_live(self, block: int, action: str) -> None:
        self._check_id(block)
        if self._refcount[block] == 0:
            raise BlockAllocatorError(f"cannot {action} block {block}: it is not allocated (double free?)")
