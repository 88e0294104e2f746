"""Fixed-size block allocator with reference counts."""

from __future__ import annotations


class BlockAllocatorError(RuntimeError):
    """A block id was freed twice, never allocated, or does not belong to this allocator."""


class BlockAllocator:
    """Hands out block ids ``0..num_blocks-1`` in O(1), with reference counts.

    Reference counts let two owners (a prefix cache, a draft sharing the target's KV) hold the same
    block; a block returns to the free list when its last reference is dropped.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # Popping from the end is O(1); reversed so that fresh allocators hand out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount: list[int] = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise BlockAllocatorError("no free blocks left")
        block = self._free.pop()
        self._refcount[block] = 1
        return block

    def share(self, block: int) -> int:
        """Add a reference to an allocated block and return it."""
        self._check_live(block, "share")
        self._refcount[block] += 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference; the block is reusable once no reference is left."""
        self._check_live(block, "free")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcount[block]

    def _check_id(self, block: int) -> None:
        if not (isinstance(block, int) and 0 <= block < self.num_blocks):
            raise BlockAllocatorError(
                f"block id {block!r} does not belong to this allocator (valid: 0..{self.num_blocks - 1})"
            )

    def _check_live(self, block: int, action: str) -> None:
        self._check_id(block)
        if self._refcount[block] == 0:
            raise BlockAllocatorError(f"cannot {action} block {block}: it is not allocated (double free?)")
