"""The ``eagle3`` / ``eagle3.1-mla`` proposers: an EAGLE3 head drafting from the target's hidden states.

Per request the proposer keeps the target's fused aux states (``combine_aux``) of the verified
positions it has not run the draft over yet. One step (FACTS.md section 3)::

    catch-up:  draft rows for every verified position p it has not seen: (token p+1, fc(h_p)),
               at position p (shifted prefill). Only requests given drafts catch up: the rows of
               one left without drafts wait for a step it drafts in (or are never run, when it
               never drafts again)
    draft 1:   argmax of the draft logits of the last catch-up row (position T-1)
    draft j:   (draft j-1, the previous row's next_hidden) at position T+j-2; fc is skipped
    roll back: the draft KV written by drafts 2..k is dropped at once: the reference keeps only
               true-hidden rows, and the accepted positions are re-run from the target's own
               hidden states at the next catch-up

where ``T = len(tokens) - 1`` is what the target has cached. The draft's KV has one of two homes:

- a pool of its own (prefix ``"draft"``; MHA drafts, and MLA drafts that cannot or may not share):
  its length is exactly the true-hidden rows, so the engine's generic truncation of every pool to
  the verified length never cuts into it;
- one extra layer of the target's MLA pool (MLA draft under an MLA target): draft position p sits
  in the target's slot for p. Its valid rows are tracked here; the draft chain grows the target
  pool's length into pages the scheduler already reserved, inside a cache scratch scope that
  restores it before the target forward.

``position_offset`` and :meth:`Eagle3Proposer._bootstrap_hidden` are the hooks for an unshifted
variant (draft row for target hidden h_p at position p+1, a bootstrap hidden at position 0).
"""

from __future__ import annotations

from typing import Hashable, Sequence

import attrs
import torch

from specdec.backends import get_backend
from specdec.backends.base import AttentionBackend, AttentionMetadata
from specdec.cache.paged_cache import PagedKVCache
from specdec.distributed import parallel_state as ps
from specdec.models.base import ForwardContext
from specdec.proposers.base import ModelProposer, Proposal, ProposerContext, ProposerPools, StepFeedback
from specdec.proposers.chain import draft_chain
from specdec.proposers.eagle3.loading import load_eagle3_draft
from specdec.proposers.eagle3.options import Eagle3Options
from specdec.proposers.eagle3.request_state import RequestState
from specdec.proposers.options import DEFAULT_DRAFT_SAMPLE_METHOD, keys_from
from specdec.runtime.block_size import choose_block_size
from specdec.runtime.model_runner import paged_metadata
from specdec.sampling.processing import greedy_ids, target_probs
from specdec.sampling.random import STREAM_DRAFT, categorical
from specdec.sampling.sampler import SamplingBatch

DRAFT_POOL = "draft"
METHODS = ("eagle3", "eagle3.1-mla")


@keys_from(Eagle3Options)
class Eagle3Proposer(ModelProposer):
    """Drafts with an EAGLE3 / EAGLE3.1 head (MHA or MLA) loaded by ``load_eagle3_draft``.

    - ``method``: ``"eagle3"`` takes the draft its config describes; an MLA draft joins the
      target's MLA pool when the latents match, no other ``block_size`` is asked for and the draft's
      backend runs that pool's pages, else it gets a pool of its own. ``"eagle3.1-mla"`` requires an
      MLA draft in the target's MLA pool.
    - ``attention_backend``: the draft's backend (default: the target's).
    - ``block_size``: the draft pool's page size (default: what its backend prefers); for a draft in
      the target's MLA pool it can only be that pool's page size.

    Greedy requests draft the argmax over the draft vocabulary mapped through ``d2t`` (q is one-hot,
    ``draft_probs`` None when the whole step is greedy), and so does every request with
    ``draft_sample_method="greedy"``. With ``"probabilistic"`` sampling requests draw each draft from
    q = ``target_probs`` of the draft logits scattered into the target vocabulary, with the
    request's parameters, seeded by (request seed, position, ``STREAM_DRAFT``), and report q.
    """

    # Draft position of the row fed with target hidden index j is j + position_offset.
    position_offset = 0
    methods: tuple[str, ...] = METHODS  # speculative methods this class serves
    default_method = "eagle3"

    def __init__(
        self,
        model: str,
        num_speculative_tokens: int,
        *,
        method: str | None = None,
        attention_backend: str | None = None,
        block_size: int | None = None,
        draft_tensor_parallel_size: int | None = None,
        draft_sample_method: str = DEFAULT_DRAFT_SAMPLE_METHOD,
        quantization: str | None = None,
    ):
        super().__init__(model, num_speculative_tokens, attention_backend=attention_backend, block_size=block_size,
                         draft_sample_method=draft_sample_method, quantization=quantization)
        self.draft_tensor_parallel_size = draft_tensor_parallel_size
        method = method or self.default_method
        if method not in self.methods:
            raise ValueError(f"unknown EAGLE3 proposer method {method!r}; choose one of {list(self.methods)}")
        self.method = method
        self.draft = None
        self.pool: str | None = None  # where the draft's KV lives
        self.shares_target_pool = False
        self.aux_layer_ids: tuple[int, ...] = ()
        self._states: dict[Hashable, RequestState] = {}

    # ----- setup -----
    def setup(self, context: ProposerContext) -> ProposerPools:
        draft = self.quantized(load_eagle3_draft(
            self.model_path, context.target, dtype=context.dtype, device=context.device, method=self._load_method(),
            shard_layer=self._shard_layer(),
        ))
        backend = get_backend(self.attention_backend) if self.attention_backend else context.backend
        shared = self._shared_pool(draft, context.target_pools, backend)
        if shared is not None:
            draft.join_pool(shared)
            self.pool, self.shares_target_pool = shared.name, True
            pools = ProposerPools(backend=backend, joined=(shared.name,))
        else:
            size = choose_block_size(
                draft, backend, self.block_size, context.kv_dtype, what="speculative config block_size"
            )
            (pool,) = [context.cache.register(p) for p in draft.kv_pools(DRAFT_POOL, size, context.kv_dtype)]
            self.pool, self.shares_target_pool = pool.name, False
            # The draft's rows continue from the target's hidden states where the target's reuse ends.
            pools = ProposerPools(backend=backend, own=(pool.name,), reuse_lead=self.position_offset)
        if self.position_offset == 0:
            # A shifted draft's row p holds (token p + 1, h_p): its pages are keyed with the token after them.
            pools = attrs.evolve(pools, successor_keyed=(self.pool,))
        self.draft = draft
        # A finished request's rows in a pool of its own are completed for the prefix cache.
        self._completes_finished = not self.shares_target_pool
        self.backend: AttentionBackend = backend
        self.cache: PagedKVCache = context.cache
        self.device = context.device
        self.aux_layer_ids = tuple(draft.aux_layer_ids)
        return pools

    def _load_method(self) -> str:
        return self.method

    # The decoder layer's default under tensor parallelism: whole on every rank. On CPUs (gloo) two
    # all-reduces per draft step cost more than the layer's own arithmetic (benchmarks/bench_tp.py).
    replicate_layer_by_default = True

    def _shard_layer(self) -> bool:
        """Whether the draft's decoder layer is split over the tensor-parallel ranks
        (``draft_tensor_parallel_size`` = the group's size) or whole on each (1)."""
        size = ps.current().size
        wanted = self.draft_tensor_parallel_size
        if wanted is None:
            return size > 1 and not self.replicate_layer_by_default
        if wanted not in (1, size):
            raise ValueError(
                f"speculative config draft_tensor_parallel_size={wanted}: the draft layer runs whole on every rank "
                f"(1) or split over all of them ({size}, the tensor_parallel_size); choose one"
            )
        return wanted > 1

    def _shared_pool(self, draft, target_pools, backend: AttentionBackend):
        """The target MLA pool the draft joins, or None for a pool of its own (errors for eagle3.1-mla)."""
        must = self.method == "eagle3.1-mla"
        if not draft.is_mla:
            return None  # load_eagle3_draft already refused an MHA draft for eagle3.1-mla
        fits = []
        for pool in target_pools:
            try:
                draft.check_pool(pool)
            except ValueError:
                continue
            fits.append(pool)
        if not fits:
            if must:
                raise ValueError(
                    "eagle3.1-mla keeps the draft in the target's MLA pool, but the target has no MLA pool with the "
                    "draft's latent shape; use method 'eagle3' to give the draft its own pool"
                )
            return None
        pool = fits[0]
        if self.block_size is not None and self.block_size != pool.block_size:
            if must:
                raise ValueError(
                    f"speculative config block_size={self.block_size}, but eagle3.1-mla keeps the draft in the "
                    f"target's MLA pool, whose pages are {pool.block_size} tokens: drop block_size or set it to "
                    f"{pool.block_size}"
                )
            return None
        if not backend.supports_block_size(pool.block_size, "mla") and not must:
            return None  # a pool of its own, at a page size the draft's backend runs
        # eagle3.1-mla joins even then: the engine's page-size check names both sides and the fix.
        return pool

    def joined_rows(self, request: Hashable) -> int:
        """Positions of the joined target pool below which the draft's rows for ``request`` are final
        (its rows trail the target's: row p waits for token p + 1)."""
        state = self._states.get(request)
        return max(0, state.done + self.position_offset) if state is not None else 0

    # ----- unshifted hooks -----
    def _bootstrap_hidden(self) -> torch.Tensor | None:
        """``[position_offset, H]`` hidden rows preceding the target's h_0 (none when shifted)."""
        return None

    # ----- proposing -----
    def propose(self, seqs: Sequence, max_drafts: Sequence[int]) -> Proposal:
        if self.draft is None:
            raise RuntimeError("Eagle3Proposer.setup() must run before propose(); the engine calls it")
        with torch.inference_mode():
            ready, post, nxt = self._catch_up(seqs, max_drafts)
            if not ready:
                return Proposal([[] for _ in seqs])
            drafting = [seqs[i] for i in ready]
            # Chain rows hold the draft's own guesses: only true-hidden rows outlive the proposal.
            with self.cache.scratch([s.seq_id for s in drafting], [self.pool]):
                return self._chain(drafting, ready, [max_drafts[i] for i in ready], post, nxt, len(seqs))

    def _catch_up(self, seqs, max_drafts, *, complete: bool = False):
        """Run the draft over the known target positions it has not seen, of the requests given drafts
        (``complete``: of every request); returns the drafting rows.

        A request left without drafts is not caught up: under the adaptive controller a step often
        drafts for some of its requests only, and running the others' rows too made its first draft
        forward one over every request that keeps draft state, not over the ones drafting.

        Returns ``(ready, post, next)``: indices into ``seqs`` that draft this step, and the
        post-norm / fed-back states of their last catch-up row (position ``T - 1``).
        """
        off = self.position_offset
        requests, tokens, positions, hidden, ready, last_rows = [], [], [], [], [], []
        for i, seq in enumerate(seqs):
            state = self._states.get(seq.seq_id)
            if state is None or not (max_drafts[i] or complete):
                continue
            verified = seq.num_tokens - 1  # positions the target has cached
            will_draft = max_drafts[i] > 0 and state.known == verified
            lo = state.done
            if lo >= state.known:
                if not will_draft:
                    continue
                lo = state.known - 1  # nothing new since the last step: re-run the last row for its logits
            hi = state.known
            hidden.append(state.take(seq.seq_id, lo))
            self._prepare_rows(seq.seq_id, lo)
            requests.append(seq.seq_id)
            tokens.append(seq.token_ids[lo + 1 : hi + 1])
            positions.append((lo + off, hi + off))
            if will_draft:
                ready.append(i)
                last_rows.append(sum(map(len, tokens)) - 1)
        if not requests:
            return [], None, None
        post, nxt = self._forward(requests, tokens, positions, torch.cat(hidden))
        if not ready:
            return [], None, None
        index = torch.tensor(last_rows, dtype=torch.long, device=post.device)
        return ready, post[index], nxt[index]

    def _prepare_rows(self, request: Hashable, lo: int) -> None:
        """Make the draft KV end at hidden index ``lo`` before rows ``lo..`` are (re)written."""
        if self.shares_target_pool:
            return  # the target's pool: its rows at verified positions are rewritten in place
        want = lo + self.position_offset
        have = self.cache.num_tokens(request, self.pool)
        if have > want:
            self.cache.truncate(request, want, [self.pool])
        elif have < want:
            raise RuntimeError(
                f"draft pool {self.pool!r} holds {have} rows of request {request!r}, expected {want}: "
                "something truncated it below the draft's verified rows"
            )

    def _chain(self, seqs, index, limits, post, nxt, batch_size) -> Proposal:
        """Draft up to ``limits[r]`` tokens per ready request from its last catch-up row."""
        fed = nxt  # the hidden state each still-drafting row feeds to its next draft step

        def advance(step: int, kept: list[int], rows: list[int], tokens: list[int]) -> torch.Tensor:
            nonlocal fed
            if len(kept) < fed.shape[0]:
                fed = fed[torch.tensor(kept, device=fed.device)]
            # Draft ``step`` (0-based) of a request with T cached tokens sits at position T - 1 + step.
            starts = [seqs[r].num_tokens - 2 + step + self.position_offset for r in rows]
            post, fed = self._forward(
                [seqs[r].seq_id for r in rows], [[t] for t in tokens], [(p, p + 1) for p in starts], fed
            )
            return post

        return draft_chain(
            seqs, index, limits, post, self._draw, advance,
            batch_size=batch_size, num_speculative_tokens=self.num_speculative_tokens,
            vocab_size=self.draft.vocab_size, device=self.device, sample=self.samples_drafts,
        )

    def calibration_step(self, requests: Sequence[Hashable]) -> bool:
        """A chain step's forward and greedy draw, from zero fed-back states (:class:`ProposerBase`)."""
        with torch.inference_mode():
            fed = self.draft.fc.weight.new_zeros(len(requests), self.draft.hidden_size)
            post, _ = self._forward(list(requests), [[0]] * len(requests), [(0, 1)] * len(requests), fed)
            self._draw(post, None, 0)
        return True

    def _draw(self, post: torch.Tensor, batch: SamplingBatch | None, step: int):
        """Draft target ids for one position (from post-norm draft states) and, when any row samples,
        their q over the target vocab. ``d2t`` maps the draft-vocabulary argmax after the reduction."""
        if batch is None:
            return self.draft.draft_to_target(self.draft.greedy_ids(post)), None
        draft_logits = self.draft.compute_logits(post)
        argmax = self.draft.draft_to_target(greedy_ids(draft_logits))
        q = target_probs(self.draft.target_logits(draft_logits), batch.temperature, batch.top_k, batch.top_p)
        tokens = categorical(q, batch.seeds, batch.counters + step, STREAM_DRAFT)
        greedy = batch.greedy.to(tokens.device)
        if bool(greedy.any()):
            # Greedy rows keep the draft-vocabulary argmax (ties broken there) with a one-hot q.
            tokens = torch.where(greedy, argmax, tokens)
            q[greedy] = 0
            q[greedy.nonzero().squeeze(1), tokens[greedy]] = 1
        return tokens, q

    def _forward(self, requests, tokens, positions, hidden):
        """One draft forward over a varlen batch: per request its tokens, at positions ``lo .. hi - 1``."""
        ctx = ForwardContext(self.backend, self.cache, {self.pool: self._metadata(requests, positions)})
        return self.draft(*self._inputs(tokens, positions), hidden, ctx)

    def _inputs(self, tokens, positions) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long, device=self.device)
        pos = torch.tensor([p for lo, hi in positions for p in range(lo, hi)], dtype=torch.long, device=self.device)
        return ids, pos

    def _metadata(self, requests, positions) -> AttentionMetadata:
        """Metadata for query positions ``lo .. hi - 1`` of each request in the draft's pool.

        Slots come from the pool's block table at the draft's own positions, which is what both homes
        need: the own pool grows by exactly these rows, and in the target's MLA pool draft position p
        is the target's slot for p (pages past the target's length are reserved by the scheduler).
        """
        cache, pool = self.cache, self.pool
        slots = []
        for request, (lo, hi) in zip(requests, positions):
            have = cache.num_tokens(request, pool)
            if lo == have:  # new rows only (a chain's step): the slots appended are theirs
                slots.append(cache.append_slots(request, hi - lo, [pool])[pool])
                continue
            if hi > have:
                cache.append_slots(request, hi - have, [pool])
            slots.append(cache.write_slots(request, pool, lo, hi))
        return paged_metadata(
            cache, pool, requests, [hi - lo for lo, hi in positions], [hi for _, hi in positions],
            torch.cat(slots), self.device,
        )

    # ----- feedback -----
    def on_step(self, feedback: StepFeedback) -> None:
        """Keep the fused target states of every verified row of the step; forget released requests.

        With ``feedback.cache_finished`` a finished request's draft rows are completed first (they
        trail its verified tokens by a step), so its pages reach the prefix cache whole."""
        finishing = [s for s in feedback.seqs if s.is_finished and s.seq_id in self._states
                     and s.seq_id not in feedback.dormant] if feedback.cache_finished and self._completes_finished else []
        if self.draft is not None and feedback.layout is not None:
            self._keep_hidden(feedback, {s.seq_id for s in finishing})
        if finishing:
            with torch.inference_mode():
                self._catch_up(finishing, [0] * len(finishing), complete=True)
        for request in feedback.released:
            self._states.pop(request, None)

    def _keep_hidden(self, feedback: StepFeedback, finishing: set) -> None:
        layout = feedback.layout
        aux = feedback.target_output.aux_hidden_states
        take: list[tuple[Hashable, int, int]] = []  # (request, first position, rows)
        index: list[int] = []
        for i, (seq, valid) in enumerate(zip(feedback.seqs, layout.kept_rows(feedback.num_accepted))):
            if seq.seq_id in feedback.dormant:
                continue  # it drafts no more: its fused states would never be read
            if seq.is_finished:
                if seq.seq_id not in finishing:
                    continue
                # Rows past a stop token hold tokens that were cut: keep the verified ones only.
                valid = min(valid, seq.num_tokens - 1 - layout.start_positions[i])
            if valid <= 0:
                continue
            take.append((seq.seq_id, layout.start_positions[i], valid))
            index.extend(range(layout.row_starts[i], layout.row_starts[i] + valid))
        if not take:
            return
        if aux is None:
            raise RuntimeError(
                f"the target forward did not capture the draft's aux layers {self.aux_layer_ids}; "
                "the engine must pass the proposer's aux_layer_ids to every target forward"
            )
        with torch.inference_mode():
            fused = self.draft.combine_aux(aux[torch.tensor(index, device=aux.device)])
        for (request, start, rows), h in zip(take, fused.split([t[2] for t in take])):
            self._append_hidden(request, start, h)

    def _append_hidden(self, request: Hashable, start: int, hidden: torch.Tensor) -> None:
        state = self._states.get(request)
        if state is None:
            # A new request. Its draft rows so far are the ones it reused from the prefix cache (its
            # pool's length; in the target's pool, the target's reuse, where this first forward starts).
            off = self.position_offset
            rows_held = start if self.shares_target_pool else self.cache.num_tokens(request, self.pool)
            done = rows_held - off
            boot = self._bootstrap_hidden() if start == 0 else None
            first = start - (boot.shape[0] if boot is not None else 0)
            if done < first:
                raise RuntimeError(
                    f"EAGLE3 proposer got target states of request {request!r} from position {start}, but its draft "
                    f"holds rows up to {rows_held}: the states in between are missing"
                )
            rows = hidden if boot is None else torch.cat([boot.to(hidden.dtype), hidden])
            self._states[request] = RequestState(rows, first, done)
        else:
            state.extend(request, start, hidden)



class Eagle3MLAProposer(Eagle3Proposer):
    """``eagle3.1-mla``: an EAGLE3.1 head with MLA attention that lives in the target's MLA pool."""

    default_method = "eagle3.1-mla"
