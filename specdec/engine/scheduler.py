"""Continuous batching: which requests run this step, and who is preempted when pages run out."""

from __future__ import annotations

from collections import deque

import attrs

from specdec.cache.paged_cache import PagedKVCache
from specdec.runtime.sequence import Sequence, SequenceStatus
from specdec.validation import int_at_least


@attrs.frozen
class SchedulerConfig:
    """Limits of one step.

    - ``max_num_seqs``: requests holding KV at once.
    - ``max_num_batched_tokens``: query tokens per forward (prefill tokens + decode tokens + drafts);
      None = no limit besides the KV cache. A prefill longer than the limit still runs, alone with
      the decodes, so that no request waits forever.
    """

    max_num_seqs: int = attrs.field(default=256, validator=int_at_least(1))
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=int_at_least(1, optional=True))

    @classmethod
    def _field_label(cls, name: str) -> str:
        return f"SchedulerConfig.{name}"


@attrs.define
class ScheduledBatch:
    """What runs this step: ``seqs[i]`` may receive up to ``max_drafts[i]`` draft tokens.

    ``preempted`` requests went back to the queue; the engine frees their pages before the forward.
    """

    seqs: list[Sequence]
    max_drafts: list[int]
    preempted: list[Sequence]


class Scheduler:
    """Admits waiting requests while KV pages allow and preempts the newest when they run out.

    Every step, running requests come first (in admission order), each reserving pages for its
    next tokens plus its drafts in every pool of the cache; when the free pages do not cover a
    request, the most recently admitted running request is preempted: its pages are freed and it
    goes back to the front of the queue, to be recomputed later from prompt + output. Waiting
    requests are then admitted (as prefills, in the same step) while pages, ``max_num_seqs`` and
    the token budget allow, unless a preemption happened this step (admitting then would thrash).

    The scheduler only *decides*: it reads the cache (free blocks, pages held) and never writes it.
    It reserves by counting, so the forwards that follow (target and proposer) cannot run out of
    pages mid-step; the engine frees the pages of the requests it preempts, finishes or aborts.
    """

    def __init__(self, config: SchedulerConfig | None = None):
        self.config = config or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._cache: PagedKVCache | None = None
        self._lookahead = 0

    def bind(self, cache: PagedKVCache, primary_pool: str, num_lookahead: int = 0) -> None:
        """Attach the (built) cache.

        ``primary_pool`` is the target's main pool (its length is what a request has computed);
        ``num_lookahead`` is k, the drafts a request may get per step. Reservations cover every
        pool of the cache, the proposer's included.
        """
        self._cache = cache
        self._primary = primary_pool
        self._lookahead = num_lookahead
        self._block_sizes = {name: pool.block_size for name, pool in cache.pools.items()}

    # ----- queue -----
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: int) -> Sequence | None:
        """The unfinished request with this id, running or waiting (None if there is none)."""
        for seq in (*self.running, *self.waiting):
            if seq.seq_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """Stop scheduling a finished request (the engine frees its pages)."""
        self.running.remove(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """Drop an unfinished request wherever it is, finished for ``reason`` (the engine frees its pages)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ----- one step -----
    def schedule(self) -> ScheduledBatch:
        cache = self._cache
        if cache is None:
            raise RuntimeError("Scheduler.bind(cache) must be called before schedule()")
        free = {name: cache.num_free_blocks(name) for name in self._block_sizes}
        budget = self.config.max_num_batched_tokens
        tokens = 0
        batch = ScheduledBatch([], [], [])

        queue = list(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            drafts = seq.max_drafts(self._lookahead)
            need = self._blocks_needed(seq, seq.num_tokens + drafts)
            while not _fits(need, free) and queue:
                victim = queue.pop()
                self._preempt(victim, free)
                batch.preempted.append(victim)
            if not _fits(need, free):
                # Nobody left to preempt but itself; it fits alone (checked at admission), later.
                self._preempt(seq, free)
                batch.preempted.append(seq)
                break
            _take(need, free)
            kept.append(seq)
            batch.seqs.append(seq)
            batch.max_drafts.append(drafts)
            tokens += self._query_len(seq) + drafts
        self.running = kept

        if not batch.preempted:
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                drafts = seq.max_drafts(self._lookahead)
                query = seq.num_tokens + drafts
                if budget is not None and tokens + query > budget and tokens > 0:
                    break
                need = self._blocks_needed(seq, seq.num_tokens + drafts)
                if not _fits(need, free):
                    break
                _take(need, free)
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                batch.seqs.append(seq)
                batch.max_drafts.append(drafts)
                tokens += query
        return batch

    # ----- helpers -----
    def _query_len(self, seq: Sequence) -> int:
        return seq.num_tokens - self._cache.num_tokens(seq.seq_id, self._primary)

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> dict[str, int]:
        # Pages hold ceil(stored / block_size) blocks exactly (the cache frees emptied pages on
        # truncate); a pool whose sequence starts past 0 (a draft sharing the prompt's KV) stores
        # only the positions from its start.
        cache, sid = self._cache, seq.seq_id
        return {
            name: -(-max(0, num_tokens - cache.sequence_start(sid, name)) // bs) - cache.blocks_held(sid, name)
            for name, bs in self._block_sizes.items()
        }

    def _preempt(self, seq: Sequence, free: dict[str, int]) -> None:
        for name in self._block_sizes:
            free[name] += self._cache.blocks_held(seq.seq_id, name)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _fits(need: dict[str, int], free: dict[str, int]) -> bool:
    return all(n <= free[name] for name, n in need.items())


def _take(need: dict[str, int], free: dict[str, int]) -> None:
    for name, n in need.items():
        free[name] -= n
