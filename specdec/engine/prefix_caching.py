"""Prefix caching: which pools are cached under which keys, how far a request reuses, what is published.

Every pool a request fills from its tokens is cached page by page at its own page size (a 16-token
draft pool beside 128-token MiniMax-M3 pages): once a page is full and final, the engine publishes it
under the chained hash of the tokens it depends on (:mod:`specdec.cache.page_keys`); freed, it stays
findable until the allocator needs the page. A newly admitted (or recomputed) request then starts from
the longest prefix its pools hold:

- the target's pools reuse one common length, a multiple of each of their page sizes;
- the proposer's own pools (one model: one common length) reuse what they hold; when the proposer
  drafts from the target's hidden states (``ProposerPools.reuse_lead``), the target must compute its
  states from position ``own - lead`` on. Where its reuse goes further (a shifted draft's page whose
  successor token differs, or an unshifted draft's boundary), the target *recomputes* those rows:
  it reads their KV from the cached pages and runs them only for their hidden states (their KV goes
  to scratch slots), so the hit rate stays the plain engine's. A chunk budget too small to hold the
  recomputed rows falls back to reusing less;
- prompt-free pools (a draft reading the prompt's KV from the target) hold no prompt and are not cached;
  their rows start at the prompt's end, so a recomputed request reuses no further than its prompt.

A request that keeps no draft state (dormant under the adaptive controller) reuses the target's pools
alone, as a plain request does. Its pages of a pool the draft joined hold no final draft rows, so they
are published under target-only keys (:func:`~specdec.cache.page_keys.target_only_key`), which only
such requests look up.

At least the request's last token is always computed (its logits are the next token's), and a request
that asks for prompt logprobs reuses nothing (they are computed with the prompt).

The counters are vLLM's: ``queries`` are the tokens of admitted requests (prompt, plus output when a
preempted request is recomputed), ``hits`` the ones the target took from cached pages.
"""

from __future__ import annotations

import math
from typing import Hashable, Mapping

import attrs

from specdec.cache.page_keys import PageKeyChain, target_only_key
from specdec.cache.paged_cache import PagedKVCache
from specdec.engine.pools import EnginePools
from specdec.proposers.base import Proposer
from specdec.runtime.sequence import Sequence


@attrs.define
class PrefixCacheStats:
    """Prompt tokens looked up (``queries``) and found cached (``hits``) since the engine was built."""

    queries: int = 0
    hits: int = 0
    recomputed: int = 0  # reused positions the target ran again for a proposer's hidden states (a cost)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def as_dict(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "hit_rate": self.hit_rate}


@attrs.frozen
class PrefixMatch:
    """What a request reuses: ``num_cached_tokens`` target positions, and per pool the cached pages.

    ``num_recomputed``: of the reused target positions, the last ones the target runs again for their
    hidden states (the proposer's draft pages end there); its first forward starts at
    ``num_cached_tokens - num_recomputed``."""

    num_cached_tokens: int
    blocks: Mapping[str, tuple[int, ...]]
    num_recomputed: int = 0


class PrefixCaching:
    """The engine's prefix cache over the pools of ``pools`` (see the module docstring)."""

    def __init__(self, cache: PagedKVCache, pools: EnginePools, proposer: Proposer | None, *, enabled: bool = True):
        self.cache = cache
        self.enabled = enabled
        self.stats = PrefixCacheStats()
        declared = pools.draft
        self._successor = frozenset(declared.successor_keyed)
        self._lead = declared.reuse_lead
        self._target = tuple(pools.target)
        self._own = tuple(p for p in declared.own if p not in declared.prompt_free)
        self._prompt_free = tuple(declared.prompt_free)
        self._joined = tuple(declared.joined)
        self._joined_rows = getattr(proposer, "joined_rows", None) if self._joined else None
        if self._joined and self._joined_rows is None:
            raise TypeError(
                f"{type(proposer).__name__} joins pools {list(self._joined)} but has no joined_rows(request); "
                "prefix caching cannot tell which of its rows there are final"
            )
        self._block_size = {name: cache.pool(name).block_size for name in self._target + self._own}
        self._chains: dict[Hashable, dict[int, PageKeyChain]] = {}

    # ----- admission -----
    def match(self, seq: Sequence, max_recompute: float = math.inf, *, drafting: bool = True) -> PrefixMatch | None:
        """The longest prefix ``seq`` can reuse now (None: nothing), recomputing at most ``max_recompute``
        target rows; reads the cache, changes nothing. ``drafting=False``: a request that keeps no draft
        state (dormant under ``adaptive``) reuses the target's pools alone, as a plain request does."""
        if not self.enabled or seq.params.prompt_logprobs is not None:
            return None
        limit = seq.num_tokens - 1  # the last token is always computed
        pools = self._target + self._own if drafting else self._target
        found = {name: self._lookup(name, self._keys(seq, name, 0, limit // self._block_size[name]), drafting)
                 for name in pools}
        own = self._group_length(self._own, found) if self._own and drafting else None
        if self._prompt_free and drafting:
            # A prompt-free pool's rows begin at the prompt's end, from the target's states there: a
            # recomputed request (preempted with output) computes its output positions again.
            own = seq.num_prompt_tokens if own is None else self._align(min(own, seq.num_prompt_tokens), self._own)
        target = self._group_length(self._target, found)
        recompute = 0
        if own is not None and self._lead is not None:
            recompute = max(0, min(target, target - own + self._lead))
            if recompute > max_recompute:
                target, recompute = self._align(min(target, own - self._lead), self._target), 0
        lengths = {**{name: target for name in self._target}, **{name: own for name in self._own}}
        blocks = {name: tuple(found[name][: lengths[name] // self._block_size[name]]) for name in pools}
        if not any(blocks.values()):
            return None
        return PrefixMatch(target, {name: b for name, b in blocks.items() if b}, recompute)

    def admit(self, seq: Sequence, match: PrefixMatch | None) -> None:
        """Start an admitted request's pools with the pages it reuses, and count the lookup."""
        self.stats.queries += seq.num_tokens
        if match is None:
            return
        self.stats.hits += match.num_cached_tokens
        self.stats.recomputed += match.num_recomputed
        for name, blocks in match.blocks.items():
            self.cache.adopt(seq.seq_id, name, blocks)

    # ----- after a step -----
    def publish(self, seq: Sequence, *, drafting: bool = True) -> None:
        """Publish every full page of ``seq`` whose content is final (positions whose tokens are known
        and verified; in a joined pool, as far as the proposer's rows are final). ``drafting=False``: a
        request keeping no draft state publishes its joined pools' pages for the target's rows alone,
        under keys only such requests look up (:func:`~specdec.cache.page_keys.target_only_key`)."""
        if not self.enabled:
            return
        request, verified = seq.seq_id, seq.num_tokens - 1
        joined_final = self._joined_rows(request) if self._joined_rows is not None and drafting else verified
        for name, bs in self._block_size.items():
            final = min(self.cache.num_tokens(request, name), verified)
            if name in self._joined:
                final = min(final, joined_final)
            first = self.cache.num_published(request, name)
            if final // bs > first:
                keys = self._keys(seq, name, first, final // bs)
                if name in self._joined and not drafting:
                    keys = list(map(target_only_key, keys))
                self.cache.publish(request, name, keys)

    def release(self, request: Hashable) -> None:
        """Forget a finished request's page keys."""
        self._chains.pop(request, None)

    # ----- helpers -----
    def _keys(self, seq: Sequence, pool: str, first: int, end: int) -> list[bytes]:
        """Content keys of ``seq``'s pages ``first .. end - 1`` in ``pool`` (its chain memoised)."""
        bs = self._block_size[pool]
        chains = self._chains.setdefault(seq.seq_id, {})
        chain = chains.get(bs)
        if chain is None:
            chain = chains[bs] = PageKeyChain(bs)
        return chain.pool_keys(seq.token_ids, first, end, pool in self._successor)

    def _lookup(self, pool: str, keys: list[bytes], drafting: bool) -> list[int]:
        """The cached blocks of ``pool`` holding the longest run of leading ``keys``; a request that reads
        the target's rows alone (not ``drafting``) takes a joined pool's page published either way."""
        if drafting or pool not in self._joined:
            return self.cache.lookup(pool, keys)
        found = []
        for key in keys:
            block = self.cache.lookup(pool, (key,)) or self.cache.lookup(pool, (target_only_key(key),))
            if not block:
                break
            found += block
        return found

    def _group_length(self, group: tuple[str, ...], found: Mapping[str, list[int]]) -> int:
        """The longest length every pool of ``group`` holds in cached pages, a multiple of each page size."""
        return self._align(min(len(found[name]) * self._block_size[name] for name in group), group)

    def _align(self, length: int, group: tuple[str, ...]) -> int:
        step = math.lcm(*(self._block_size[name] for name in group))
        return max(0, length // step * step)
