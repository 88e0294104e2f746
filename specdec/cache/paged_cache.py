"""The composable paged KV cache: named pools with their own page sizes under one memory budget."""

from __future__ import annotations

import contextlib
import math
from typing import Hashable, Iterable, Iterator, Sequence

import attrs
import torch

from specdec.cache.allocator import BlockAllocator
from specdec.cache.pool import KVPool
from specdec.validation import is_int


class KVCacheError(RuntimeError):
    """Base class of the cache's errors."""


class RequestTooLargeError(KVCacheError, ValueError):
    """A request can never fit, even with the whole budget to itself."""


class OutOfBlocksError(KVCacheError):
    """Not enough free blocks now; the scheduler should preempt and retry."""


@attrs.define
class _PoolSequence:
    """One request's pages in one pool, indexed by logical token position.

    The pool holds positions ``start .. num_tokens - 1``; positions before ``start`` live elsewhere
    (a draft that reads the target's KV at prompt positions keeps only what follows the prompt).
    """

    blocks: list[int] = attrs.field(factory=list)
    num_tokens: int = 0
    start: int = 0
    num_published: int = 0  # leading pages carrying a content key (immutable from then on)

    @property
    def num_stored(self) -> int:
        return self.num_tokens - self.start


class PagedKVCache:
    """Pools registered by name, each with its own page size, dtype and layers.

    Engines and proposers register pools (``"target"``, ``"draft"``, ...), then :meth:`build` splits
    ``memory_budget`` bytes across them by per-token cost, so every pool can hold the same number of
    tokens. Each request keeps a block table and a length per pool: a 128-token-page target pool and a
    16-token-page draft pool coexist without either being padded to the other's page size.

    Lengths are logical positions. A request's sequence in a pool may begin past position 0
    (:meth:`set_start`): its pages then hold positions ``start ..`` only, ``num_tokens`` stays the
    logical end, and slots index pages relative to ``start``.
    """

    def __init__(self, memory_budget: int, device: torch.device | str = "cpu"):
        if memory_budget <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {memory_budget}")
        self.memory_budget = int(memory_budget)
        self.device = torch.device(device)
        self._pools: dict[str, KVPool] = {}
        self._allocators: dict[str, BlockAllocator] = {}
        self._seqs: dict[Hashable, dict[str, _PoolSequence]] = {}

    # ----- pools -----
    def register(self, pool: KVPool) -> KVPool:
        if self.is_built:
            raise KVCacheError(f"cannot register pool {pool.name!r}: the cache is already built")
        if pool.name in self._pools:
            raise KVCacheError(f"a pool named {pool.name!r} is already registered")
        self._pools[pool.name] = pool
        return pool

    def pool(self, name: str) -> KVPool:
        try:
            return self._pools[name]
        except KeyError:
            raise KeyError(f"no pool named {name!r}; registered: {sorted(self._pools)}") from None

    @property
    def pools(self) -> dict[str, KVPool]:
        return dict(self._pools)

    @property
    def is_built(self) -> bool:
        return bool(self._allocators)

    def build(self) -> dict[str, int]:
        """Split the budget by per-token cost and allocate every pool; returns token capacities."""
        if self.is_built:
            raise KVCacheError("the cache is already built")
        if not self._pools:
            raise KVCacheError("no pools registered")
        total_cost = sum(p.bytes_per_token() for p in self._pools.values())
        tokens = self.memory_budget // total_cost
        for pool in self._pools.values():
            num_blocks = tokens // pool.block_size
            pool.materialize(num_blocks, self.device)
            self._allocators[pool.name] = BlockAllocator(num_blocks)
        return self.capacity()

    def capacity(self) -> dict[str, int]:
        """Tokens each pool can hold in all."""
        return {name: p.num_blocks * p.block_size for name, p in self._pools.items()}

    def allocated_bytes(self) -> int:
        return sum(p.num_blocks * p.bytes_per_block() for p in self._pools.values())

    def bytes_needed(self, num_tokens: int) -> int:
        """The smallest budget that holds one request of ``num_tokens`` tokens in every pool."""
        total_cost = sum(p.bytes_per_token() for p in self._pools.values())
        tokens = max(math.ceil(num_tokens / p.block_size) * p.block_size for p in self._pools.values())
        return tokens * total_cost

    def usage(self) -> float:
        """The share of the allocated KV bytes that requests hold now (0 when nothing is allocated)."""
        total = self.allocated_bytes()
        used = sum(self._allocators[n].num_used * p.bytes_per_block() for n, p in self._pools.items())
        return used / total if total else 0.0

    def num_free_blocks(self, pool: str) -> int:
        return self._allocators[pool].num_free

    def allocator(self, pool: str) -> BlockAllocator:
        return self._allocators[pool]

    # ----- requests -----
    def check_fits(self, num_tokens: int, pools: Iterable[str] | None = None) -> None:
        """Raise :class:`RequestTooLargeError` if ``num_tokens`` can never fit in some pool."""
        self._require_built()
        for name in self._names(pools):
            pool = self._pools[name]
            if math.ceil(num_tokens / pool.block_size) > pool.num_blocks:
                raise RequestTooLargeError(
                    f"a request of {num_tokens} tokens does not fit the KV cache: pool {name!r} holds "
                    f"{pool.num_blocks * pool.block_size} tokens in all; raise kv_cache_memory to at least "
                    f"{self.bytes_needed(num_tokens)} bytes or lower max_tokens / the prompt length"
                )

    def can_admit(self, request: Hashable, num_tokens: int, pools: Iterable[str] | None = None) -> bool:
        """Whether ``request`` can grow to ``num_tokens`` tokens in every pool with the free blocks now."""
        self._require_built()
        seqs = self._seqs.get(request, {})
        for name in self._names(pools):
            seq = seqs.get(name)
            have = len(seq.blocks) if seq else 0
            start = seq.start if seq else 0
            need = math.ceil(max(0, num_tokens - start) / self._pools[name].block_size) - have
            if need > self._allocators[name].num_free:
                return False
        return True

    def append_slots(
        self, request: Hashable, num_new: int, pools: Iterable[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Extend ``request`` by ``num_new`` tokens; returns, per pool, their slots (int64 ``[num_new]``).

        A slot is ``block_id * block_size + offset``. All-or-nothing: if any pool lacks blocks, nothing
        is allocated and :class:`OutOfBlocksError` is raised.
        """
        self._require_built()
        names = self._names(pools)
        seqs = self._seqs.setdefault(request, {})
        plan = []
        for name in names:
            pool, seq = self._pools[name], seqs.get(name)
            new_len = (seq.num_stored if seq else 0) + num_new
            total = -(-new_len // pool.block_size)
            if total > pool.num_blocks:
                self.check_fits(new_len, [name])
            need = total - (len(seq.blocks) if seq else 0)
            if seq is not None and seq.num_stored % pool.block_size and self._is_frozen(name, seq.blocks[-1]):
                raise KVCacheError(
                    f"request {request!r} would write into page {seq.blocks[-1]} of pool {name!r}, which is shared "
                    "or prefix-cached; cached pages are read-only"
                )
            if need > self._allocators[name].num_free:
                raise OutOfBlocksError(f"pool {name!r} has too few free blocks for {num_new} more tokens")
            plan.append((name, pool, need))
        slots = {}
        for name, pool, need in plan:
            allocator = self._allocators[name]
            seq = seqs.setdefault(name, _PoolSequence())
            for _ in range(need):
                seq.blocks.append(allocator.allocate())
            seq.num_tokens += num_new
            slots[name] = self.slots(request, name, seq.num_tokens - num_new, seq.num_tokens)
        return slots

    def slots(self, request: Hashable, pool: str, start: int, end: int) -> torch.Tensor:
        """The slots (``block_id * block_size + offset``) of logical positions ``start .. end - 1``, int64.

        The positions must be held: ``sequence_start <= start`` and ``end <= num_tokens``. Pages are
        indexed from the sequence's start (see :meth:`set_start`).
        """
        seq = self._seqs.get(request, {}).get(pool)
        first, held = (seq.start, seq.num_tokens) if seq else (0, 0)
        if not first <= start <= end <= held:
            raise KVCacheError(
                f"request {request!r} holds positions {first}..{held - 1} in pool {pool!r}, asked for slots of "
                f"{start}..{end - 1}"
            )
        bs, blocks = self._pools[pool].block_size, seq.blocks if seq else []
        return torch.tensor(
            [blocks[p // bs] * bs + p % bs for p in range(start - first, end - first)], dtype=torch.int64
        )

    def write_slots(self, request: Hashable, pool: str, start: int, end: int) -> torch.Tensor:
        """:meth:`slots` of positions about to be (re)written: refuses pages that another request shares
        or that carry a prefix-cache key (their content must not change while anyone may read it)."""
        seq = self._seqs.get(request, {}).get(pool)
        if seq is not None and end > start:
            bs = self._pools[pool].block_size
            for page in range((start - seq.start) // bs, -(-(end - seq.start) // bs)):
                if self._is_frozen(pool, seq.blocks[page]):
                    raise KVCacheError(
                        f"request {request!r} would rewrite positions {start}..{end - 1} of pool {pool!r}, but page "
                        f"{seq.blocks[page]} is shared or prefix-cached; cached pages are read-only"
                    )
        return self.slots(request, pool, start, end)

    def _is_frozen(self, pool: str, block: int) -> bool:
        allocator = self._allocators[pool]
        return allocator.refcount(block) > 1 or allocator.is_published(block)

    # ----- prefix caching -----
    def lookup(self, pool: str, keys: Iterable[bytes]) -> list[int]:
        """The cached blocks of ``pool`` holding the longest run of leading ``keys`` (page content keys,
        :mod:`specdec.cache.page_keys`)."""
        allocator, found = self._allocators[pool], []
        for key in keys:
            block = allocator.lookup(key)
            if block is None:
                break
            found.append(block)
        return found

    def num_evictable(self, pool: str, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` (found by :meth:`lookup`) are unreferenced: adopting them takes them
        out of the free pages."""
        allocator = self._allocators[pool]
        return sum(allocator.refcount(b) == 0 for b in blocks)

    def adopt(self, request: Hashable, pool: str, blocks: Sequence[int]) -> None:
        """Begin ``request``'s sequence in ``pool`` with the cached pages ``blocks`` (from :meth:`lookup`):
        it holds their positions ``0 .. len(blocks) * block_size - 1`` without computing them. Only while
        it holds nothing there."""
        self._require_built()
        seqs = self._seqs.setdefault(request, {})
        seq = seqs.get(pool)
        if seq is not None and (seq.num_tokens or seq.blocks):
            raise KVCacheError(f"request {request!r} already holds tokens in pool {pool!r}; adopt cached pages first")
        allocator = self._allocators[pool]
        held = [allocator.acquire(b) for b in blocks]
        n = len(held)
        seqs[pool] = _PoolSequence(held, n * self._pools[pool].block_size, 0, n)

    def num_published(self, request: Hashable, pool: str) -> int:
        """How many leading pages of ``request`` in ``pool`` carry a content key."""
        seq = self._seqs.get(request, {}).get(pool)
        return seq.num_published if seq else 0

    def publish(self, request: Hashable, pool: str, keys: Sequence[bytes]) -> None:
        """Key ``request``'s next pages in ``pool`` (from :meth:`num_published` on, one key per page, each
        page full and final): they become findable by other requests and read-only."""
        seq = self._seqs.get(request, {}).get(pool)
        if seq is None or not keys:
            return
        end = seq.num_published + len(keys)
        if seq.start or end * self._pools[pool].block_size > seq.num_tokens:
            raise KVCacheError(
                f"cannot publish pages up to {end} of request {request!r} in pool {pool!r}: it holds positions "
                f"{seq.start}..{seq.num_tokens - 1}"
            )
        allocator = self._allocators[pool]
        for page, key in enumerate(keys, start=seq.num_published):
            allocator.publish(seq.blocks[page], key)
        seq.num_published = end

    def num_freeable(self, request: Hashable, pool: str) -> int:
        """Pages of ``request`` in ``pool`` that freeing it would return (the ones nobody else holds)."""
        seq = self._seqs.get(request, {}).get(pool)
        allocator = self._allocators[pool]
        return sum(allocator.refcount(b) == 1 for b in seq.blocks) if seq else 0

    @contextlib.contextmanager
    def scratch(self, requests: Iterable[Hashable], pools: Iterable[str]) -> Iterator[None]:
        """A scope whose appends to ``requests`` in ``pools`` are transient.

        On exit every (request, pool) is truncated back to its length at entry, its new pages freed:
        what a drafter writes past what it keeps (draft chain rows, or rows it puts in a target pool
        ahead of the target) never outlives the proposal.
        """
        names = self._names(pools)
        lengths = [(r, name, self.num_tokens(r, name)) for r in requests for name in names]
        try:
            yield
        finally:
            for request, name, length in lengths:
                if self.num_tokens(request, name) > length:
                    self.truncate(request, length, [name])

    def set_start(self, request: Hashable, start: int, pools: Iterable[str]) -> None:
        """Begin ``request``'s sequence in ``pools`` at logical position ``start`` instead of 0.

        Its pages there will hold positions ``start ..`` only (the ones before are read from another
        pool). Only while the request holds nothing in those pools.
        """
        if not (is_int(start) and start >= 0):
            raise ValueError(f"a sequence start must be an int >= 0, got {start!r}")
        names = self._names(pools)
        seqs = self._seqs.get(request, {})
        for name in names:
            seq = seqs.get(name)
            if seq is not None and seq.num_stored:
                raise KVCacheError(
                    f"cannot move the start of request {request!r} in pool {name!r}: it already holds "
                    f"{seq.num_stored} tokens there; set the start before the first append"
                )
        seqs = self._seqs.setdefault(request, {})
        for name in names:
            seqs[name] = _PoolSequence(start=start, num_tokens=start)

    def sequence_start(self, request: Hashable, pool: str) -> int:
        """The first logical position ``request`` keeps in ``pool`` (0 unless :meth:`set_start` moved it)."""
        seq = self._seqs.get(request, {}).get(pool)
        return seq.start if seq else 0

    def blocks_held(self, request: Hashable, pool: str) -> int:
        """How many pages ``request`` holds in ``pool``."""
        seq = self._seqs.get(request, {}).get(pool)
        return len(seq.blocks) if seq else 0

    def truncate(self, request: Hashable, new_len: int, pools: Iterable[str] | None = None) -> None:
        """Roll ``request`` back to ``new_len`` tokens (rejected drafts), freeing pages left empty."""
        seqs = self._seqs.get(request, {})
        for name in self._names(pools):
            seq = seqs.get(name)
            if seq is None:
                if new_len:
                    raise KVCacheError(f"request {request!r} holds no tokens in pool {name!r}")
                continue
            if new_len > seq.num_tokens or new_len < seq.start:
                held = str(seq.num_tokens) if not seq.start else f"positions {seq.start}..{seq.num_tokens - 1}"
                raise KVCacheError(
                    f"cannot truncate request {request!r} in pool {name!r} to {new_len} tokens: it has {held}"
                )
            seq.num_tokens = new_len
            keep = math.ceil(seq.num_stored / self._pools[name].block_size)
            allocator = self._allocators[name]
            while len(seq.blocks) > keep:
                allocator.free(seq.blocks.pop())
            seq.num_published = min(seq.num_published, new_len // self._pools[name].block_size)

    def free(self, request: Hashable) -> None:
        """Release every page ``request`` holds in every pool (finish or preemption)."""
        for name, seq in self._seqs.pop(request, {}).items():
            allocator = self._allocators[name]
            # Tail first: eviction (least recently freed first) then takes a chain's tail before its head.
            for block in reversed(seq.blocks):
                allocator.free(block)

    def num_tokens(self, request: Hashable, pool: str) -> int:
        """The logical length of ``request`` in ``pool``: one past the last position it holds."""
        seq = self._seqs.get(request, {}).get(pool)
        return seq.num_tokens if seq else 0

    def block_table(self, request: Hashable, pool: str) -> list[int]:
        seq = self._seqs.get(request, {}).get(pool)
        return list(seq.blocks) if seq else []

    def block_tables(self, requests: Iterable[Hashable], pool: str) -> torch.Tensor:
        """Block tables of ``requests`` in ``pool`` as int32 ``[len(requests), max_blocks]``, 0-padded."""
        rows = [self._seqs.get(r, {}).get(pool) for r in requests]
        rows = [seq.blocks if seq else [] for seq in rows]
        width = max(max((len(r) for r in rows), default=0), 1)
        return torch.tensor([blocks + [0] * (width - len(blocks)) for blocks in rows], dtype=torch.int32).view(
            len(rows), width
        )

    def requests(self) -> list[Hashable]:
        return list(self._seqs)

    # ----- helpers -----
    def _names(self, pools: Iterable[str] | None) -> list[str]:
        if pools is None:
            return list(self._pools)
        names = list(pools)
        for name in names:
            self.pool(name)
        return names

    def _require_built(self) -> None:
        if not self.is_built:
            raise KVCacheError("the cache is not built yet: call build() after registering pools")
