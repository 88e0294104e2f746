"""Continuous batching: which requests run this step, and who is preempted when pages run out."""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Collection, Hashable

import attrs

from specdec.cache.paged_cache import PagedKVCache
from specdec.engine.prefix_caching import PrefixCaching, PrefixMatch
from specdec.runtime.sequence import Sequence, SequenceStatus
from specdec.validation import int_at_least


@attrs.frozen
class SchedulerConfig:
    """Limits of one step.

    - ``max_num_seqs``: requests holding KV at once.
    - ``max_num_batched_tokens``: query tokens per forward (prefill chunks + decode tokens + drafts);
      None = no limit besides the KV cache. A prefill longer than what is left of the budget runs in
      chunks over several steps (chunked prefill); decodes are scheduled first.
    """

    max_num_seqs: int = attrs.field(default=256, validator=int_at_least(1))
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=int_at_least(1, optional=True))

    @classmethod
    def _field_label(cls, name: str) -> str:
        return f"SchedulerConfig.{name}"


@attrs.define
class ScheduledBatch:
    """What runs this step: ``seqs[i]`` computes its next ``num_new_tokens[i]`` tokens (its whole
    remainder, or a chunk of its prompt) and may receive up to ``max_drafts[i]`` draft tokens.

    ``preempted`` requests went back to the queue; the engine frees their pages before the forward.
    ``reuse`` maps each newly admitted request that starts from cached pages to its
    :class:`~specdec.engine.prefix_caching.PrefixMatch`; the engine adopts the pages.
    """

    seqs: list[Sequence] = attrs.field(factory=list)
    num_new_tokens: list[int] = attrs.field(factory=list)
    max_drafts: list[int] = attrs.field(factory=list)
    preempted: list[Sequence] = attrs.field(factory=list)
    reuse: dict[int, PrefixMatch] = attrs.field(factory=dict)

    def add(self, seq: Sequence, rows: int, drafts: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(rows)
        self.max_drafts.append(drafts)


class Scheduler:
    """Admits waiting requests while KV pages and the token budget allow; preempts the newest when
    pages run out.

    Every step, running requests come first: decodes (in admission order), then prompts being
    prefilled in chunks; each reserves pages for its rows plus its drafts in every pool of the cache.
    When the free pages do not cover a request, the most recently admitted running request still
    unscheduled is preempted: its pages are freed and it goes back to the front of the queue, to be
    recomputed later from prompt + output (as is, at the start of the next step, a request the engine
    asks to :meth:`recompute`). Waiting requests are then admitted (starting from the longest cached
    prefix when prefix caching is on; on the target's pools alone for one starting dormant) while pages,
    ``max_num_seqs`` and the token budget allow, unless a preemption happened this step (admitting then
    would thrash). A request
    gets drafts only in a step that computes its last token; a prompt chunk that ends earlier has
    none, and a running request left without budget waits for the next step, keeping its pages.

    The scheduler only *decides*: it reads the cache (free blocks, pages held, cached pages) and never
    writes it. It reserves by counting, so the forwards that follow (target and proposer) cannot run
    out of pages mid-step; the engine frees the pages of the requests it preempts, finishes or aborts.
    """

    def __init__(self, config: SchedulerConfig | None = None):
        self.config = config or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._recompute: set = set()  # running requests to send back to the queue at the next step
        self._cache: PagedKVCache | None = None
        self._prefix: PrefixCaching | None = None
        self._lookahead = 0

    def bind(
        self, cache: PagedKVCache, primary_pool: str, num_lookahead: int = 0, prefix: PrefixCaching | None = None,
        dormant: Callable[[list[Hashable]], Collection[Hashable]] | None = None,
    ) -> None:
        """Attach the (built) cache.

        ``primary_pool`` is the target's main pool (its length is what a request has computed);
        ``num_lookahead`` is k, the drafts a request may get per step; ``prefix`` finds the cached
        pages a newly admitted request can reuse. Reservations cover every pool of the cache, the
        proposer's included. ``dormant``: given a step's requests, the ones that keep no draft state
        (the adaptive controller's ``admit``, which decides for the newly admitted as it is asked).
        """
        self._cache = cache
        self._primary = primary_pool
        self._lookahead = num_lookahead
        self._prefix = prefix
        self._dormant = dormant
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

    def recompute(self, seq: Sequence) -> None:
        """At the next step, send running ``seq`` back to the front of the queue to be recomputed from
        prompt + output, as a preemption does (not counted as one): the adaptive controller waking a
        dormant request, whose draft state only a recompute rebuilds."""
        self._recompute.add(seq.seq_id)

    # ----- one step -----
    def schedule(self) -> ScheduledBatch:
        cache = self._cache
        if cache is None:
            raise RuntimeError("Scheduler.bind(cache) must be called before schedule()")
        free = {name: cache.num_free_blocks(name) for name in self._block_sizes}
        budget = self.config.max_num_batched_tokens
        left = math.inf if budget is None else budget
        batch = ScheduledBatch()
        preempted, self._recompute = self._recompute, set()
        for seq in self.running:
            if seq.seq_id in preempted:
                self._preempt(seq, free, counted=False)
                batch.preempted.append(seq)

        # Decodes first, then prompts part-way through their prefill (vLLM's order).
        queue = sorted((s for s in self.running if s.seq_id not in preempted), key=lambda s: self._query_len(s) > 1)
        while queue:
            seq = queue.pop(0)
            cached = cache.num_tokens(seq.seq_id, self._primary)
            rows, drafts = self._rows(seq, seq.num_tokens - cached, left)
            if rows == 0:
                continue  # no budget left this step: it keeps its pages and runs later
            need = self._blocks_needed(seq, cached + rows + drafts)
            while not _fits(need, free) and queue:
                victim = queue.pop()
                self._preempt(victim, free)
                batch.preempted.append(victim)
                preempted.add(victim.seq_id)
            if not _fits(need, free):
                # Nobody left to preempt but itself; it fits alone (checked at admission), later.
                self._preempt(seq, free)
                batch.preempted.append(seq)
                preempted.add(seq.seq_id)
                break
            _take(need, free)
            batch.add(seq, rows, drafts)
            left -= rows + drafts
        self.running = [s for s in self.running if s.seq_id not in preempted]

        admitted: dict[int, dict[str, int]] = {}  # index in the batch -> the pages it took
        if not batch.preempted:
            while self.waiting and len(self.running) < self.config.max_num_seqs and left > 0:
                seq = self.waiting[0]
                # Rows the target recomputes at reused positions must fit this step's chunk.
                match = self._prefix.match(seq, left - 1) if self._prefix is not None else None
                cached = match.num_cached_tokens if match is not None else 0
                recompute = match.num_recomputed if match is not None else 0
                rows, drafts = self._rows(seq, seq.num_tokens - cached + recompute, left, whole=not batch.seqs)
                if rows == 0:
                    break
                # The forward appends all its rows before giving the recomputed ones' slots back.
                need = self._blocks_needed(seq, cached + rows + drafts, match)
                if not _fits(need, free):
                    break
                _take(need, free)
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                admitted[len(batch.seqs)] = need
                batch.add(seq, rows, drafts)
                if match is not None:
                    batch.reuse[seq.seq_id] = match
                left -= rows + drafts
        if admitted and self._dormant is not None and self._prefix is not None:
            self._match_dormant(batch, admitted, free)
        return batch

    def _match_dormant(self, batch: ScheduledBatch, admitted: dict[int, dict[str, int]], free: dict[str, int]) -> None:
        """Match the requests just admitted that start dormant again, on the target's pools alone: they
        keep no draft state, so they reuse what a plain request would, and the target recomputes no
        reused rows for a draft's hidden states. Whether a request starts dormant depends on the step's
        requests, so it is asked once they are all admitted. The new match never runs more rows (it
        reuses at least as much of the target's pools); it is taken where its pages fit."""
        dormant = self._dormant([seq.seq_id for seq in batch.seqs])
        for i, taken in admitted.items():
            seq = batch.seqs[i]
            if seq.seq_id not in dormant:
                continue
            old, match = batch.reuse.get(seq.seq_id), self._prefix.match(seq, drafting=False)
            if match == old:
                continue
            cached = match.num_cached_tokens if match is not None else 0
            rows, drafts = self._rows(seq, seq.num_tokens - cached, batch.num_new_tokens[i] + batch.max_drafts[i])
            need = self._blocks_needed(seq, cached + rows + drafts, match)
            _take({name: -n for name, n in taken.items()}, free)  # give back what the first match took
            if not _fits(need, free):
                _take(taken, free)
                continue
            _take(need, free)
            batch.num_new_tokens[i], batch.max_drafts[i] = rows, drafts
            batch.reuse.pop(seq.seq_id, None)
            if match is not None:
                batch.reuse[seq.seq_id] = match

    def _rows(self, seq: Sequence, remaining: int, left: float, whole: bool = False) -> tuple[int, int]:
        """Rows and drafts ``seq`` runs with ``left`` budget tokens: its ``remaining`` uncached tokens or a
        chunk of them (no drafts then). A request asking for prompt logprobs is never chunked: it runs
        whole, alone if it must (``whole``: nothing else is scheduled yet), or waits."""
        if remaining > left and seq.params.prompt_logprobs is not None:
            return (remaining, 0) if whole else (0, 0)
        rows = int(min(remaining, left))
        drafts = seq.max_drafts(self._lookahead) if rows == remaining else 0
        return rows, int(min(drafts, left - rows))

    # ----- helpers -----
    def _query_len(self, seq: Sequence) -> int:
        return seq.num_tokens - self._cache.num_tokens(seq.seq_id, self._primary)

    def _blocks_needed(self, seq: Sequence, num_tokens: int, match: PrefixMatch | None = None) -> dict[str, int]:
        # Pages hold ceil(stored / block_size) blocks exactly (the cache frees emptied pages on
        # truncate); a pool whose sequence starts past 0 (a draft sharing the prompt's KV) stores
        # only the positions from its start. Cached pages a request adopts need no new page, but an
        # unreferenced one leaves the free pages when it is taken.
        cache, sid = self._cache, seq.seq_id
        need = {}
        for name, bs in self._block_sizes.items():
            pages = -(-max(0, num_tokens - cache.sequence_start(sid, name)) // bs) - cache.blocks_held(sid, name)
            reused = match.blocks.get(name, ()) if match is not None else ()
            need[name] = max(0, pages - len(reused)) + (cache.num_evictable(name, reused) if reused else 0)
        return need

    def _preempt(self, seq: Sequence, free: dict[str, int], counted: bool = True) -> None:
        for name in self._block_sizes:
            free[name] += self._cache.num_freeable(seq.seq_id, name)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += counted


def _fits(need: dict[str, int], free: dict[str, int]) -> bool:
    return all(n <= free[name] for name, n in need.items())


def _take(need: dict[str, int], free: dict[str, int]) -> None:
    for name, n in need.items():
        free[name] -= n
