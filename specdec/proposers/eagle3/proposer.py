"""The ``eagle3`` / ``eagle3.1-mla`` proposers: an EAGLE3 head drafting from the target's hidden states.

Per request the proposer keeps the target's fused aux states (``combine_aux``) of the verified
positions it has not run the draft over yet. One step (FACTS.md section 3)::

    catch-up:  draft rows for every verified position p it has not seen: (token p+1, fc(h_p)),
               at position p (shifted prefill; chunked target prefills are caught up as they come)
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
  in the target's slot for p. Its valid rows are tracked here; drafting may temporarily grow the
  target pool's length into pages the scheduler already reserved, and restores it before the
  target forward.

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
from specdec.engine.blocks import choose_block_size
from specdec.models.base import ForwardContext
from specdec.proposers.base import Proposal, ProposerBase, ProposerContext, StepFeedback
from specdec.proposers.eagle3.loading import load_eagle3_draft
from specdec.sampling.processing import greedy_ids, target_probs
from specdec.sampling.random import STREAM_DRAFT, categorical
from specdec.sampling.sampler import SamplingBatch

DRAFT_POOL = "draft"
METHODS = ("eagle3", "eagle3.1-mla")


@attrs.define
class _RequestState:
    """What the proposer remembers of one request.

    ``hidden`` holds fused target states (``[n, H]``) for hidden indices ``hidden_start ..
    hidden_start + n - 1``; ``done`` is how many hidden indices (from ``-position_offset``) the draft
    has run over with these true states. The last consumed row stays in ``hidden`` so a step with
    nothing new can re-run it.
    """

    hidden: torch.Tensor
    hidden_start: int
    done: int

    @property
    def known(self) -> int:
        """Hidden indices known so far: the target has computed positions ``< known``."""
        return self.hidden_start + self.hidden.shape[0]


class Eagle3Proposer(ProposerBase):
    """Drafts with an EAGLE3 / EAGLE3.1 head (MHA or MLA) loaded by ``load_eagle3_draft``.

    - ``method``: ``"eagle3"`` takes the draft its config describes; an MLA draft joins the
      target's MLA pool when the latents match, no other ``block_size`` is asked for and the draft's
      backend runs that pool's pages, else it gets a pool of its own. ``"eagle3.1-mla"`` requires an
      MLA draft in the target's MLA pool.
    - ``attention_backend``: the draft's backend (default: the target's).
    - ``block_size``: the draft pool's page size (default: what its backend prefers); for a draft in
      the target's MLA pool it can only be that pool's page size.

    Greedy requests draft the argmax over the draft vocabulary mapped through ``d2t`` (q is one-hot,
    ``draft_probs`` None when the whole step is greedy). Sampling requests draw each draft from
    q = ``target_probs`` of the draft logits scattered into the target vocabulary, with the
    request's parameters, seeded by (request seed, position, ``STREAM_DRAFT``), and report q.
    """

    # Draft position of the row fed with target hidden index j is j + position_offset.
    position_offset = 0
    methods: tuple[str, ...] = METHODS  # speculative methods this class serves

    def __init__(
        self,
        model: str,
        num_speculative_tokens: int,
        *,
        method: str = "eagle3",
        attention_backend: str | None = None,
        block_size: int | None = None,
    ):
        if not (isinstance(num_speculative_tokens, int) and num_speculative_tokens >= 1):
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {num_speculative_tokens!r}")
        if method not in self.methods:
            raise ValueError(f"unknown EAGLE3 proposer method {method!r}; choose one of {list(self.methods)}")
        self.model_path = model
        self.num_speculative_tokens = num_speculative_tokens
        self.method = method
        self.attention_backend = attention_backend
        self.block_size = block_size
        self.draft = None
        self.pool: str | None = None  # where the draft's KV lives
        self.shares_target_pool = False
        self.aux_layer_ids: tuple[int, ...] = ()
        self._states: dict[Hashable, _RequestState] = {}

    @classmethod
    def from_config(cls, config) -> "Eagle3Proposer":
        return cls(
            config.model,
            config.num_speculative_tokens,
            method=config.method,
            attention_backend=config.attention_backend,
            block_size=config.block_size,
        )

    # ----- setup -----
    def setup(self, context: ProposerContext) -> None:
        draft = load_eagle3_draft(
            self.model_path, context.target, dtype=context.dtype, device=context.device, method=self._load_method()
        )
        backend = get_backend(self.attention_backend) if self.attention_backend else context.backend
        shared = self._shared_pool(draft, context.target_pools, backend)
        if shared is not None:
            draft.join_pool(shared)
            self.pool, self.shares_target_pool, self.pool_names = shared.name, True, ()
        else:
            size = choose_block_size(
                draft, backend, self.block_size, context.dtype, what="speculative config block_size"
            )
            (pool,) = [context.cache.register(p) for p in draft.kv_pools(DRAFT_POOL, size, context.dtype)]
            self.pool, self.shares_target_pool, self.pool_names = pool.name, False, (pool.name,)
        self.draft = draft
        self.backend: AttentionBackend = backend
        self.cache: PagedKVCache = context.cache
        self.device = context.device
        self.aux_layer_ids = tuple(draft.aux_layer_ids)

    def _load_method(self) -> str:
        return self.method

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

    # ----- unshifted hooks -----
    def _bootstrap_hidden(self) -> torch.Tensor | None:
        """``[position_offset, H]`` hidden rows preceding the target's h_0 (none when shifted)."""
        return None

    # ----- proposing -----
    def propose(self, seqs: Sequence, max_drafts: Sequence[int]) -> Proposal:
        if self.draft is None:
            raise RuntimeError("Eagle3Proposer.setup() must run before propose(); the engine calls it")
        drafts: list[list[int]] = [[] for _ in seqs]
        restore = {}  # request -> pool length to return to after drafting
        with torch.inference_mode():
            ready, post, nxt = self._catch_up(seqs, max_drafts, restore)
            if ready:
                probs = self._chain([seqs[i] for i in ready], [max_drafts[i] for i in ready], post, nxt, ready,
                                    drafts, len(seqs))
            else:
                probs = None
        for request, length in restore.items():
            if self.cache.num_tokens(request, self.pool) > length:
                self.cache.truncate(request, length, [self.pool])
        return Proposal(drafts, probs)

    def _catch_up(self, seqs, max_drafts, restore):
        """Run the draft over every known target position it has not seen; returns the drafting rows.

        Returns ``(ready, post, next)``: indices into ``seqs`` that draft this step, and the
        post-norm / fed-back states of their last catch-up row (position ``T - 1``).
        """
        off = self.position_offset
        requests, tokens, positions, hidden, ready, last_rows = [], [], [], [], [], []
        for i, seq in enumerate(seqs):
            state = self._states.get(seq.seq_id)
            if state is None:
                continue
            verified = seq.num_tokens - 1  # positions the target has cached
            will_draft = max_drafts[i] > 0 and state.known == verified
            lo = state.done
            if lo >= state.known:
                if not will_draft:
                    continue
                lo = state.known - 1  # nothing new since the last step: re-run the last row for its logits
            if lo < state.hidden_start:
                raise RuntimeError(
                    f"EAGLE3 proposer lost track of request {seq.seq_id!r}: it needs the target state of position "
                    f"{lo} but keeps them from {state.hidden_start}"
                )
            hi = state.known
            self._prepare_rows(seq.seq_id, lo, restore)
            requests.append(seq.seq_id)
            tokens.append(seq.token_ids[lo + 1 : hi + 1])
            positions.append(list(range(lo + off, hi + off)))
            hidden.append(state.hidden[lo - state.hidden_start : hi - state.hidden_start])
            state.done = hi
            # Keep only the last consumed row (for a step that brings nothing new); a copy, so the
            # prompt's states are released now rather than at the next step.
            state.hidden, state.hidden_start = state.hidden[hi - 1 - state.hidden_start :].clone(), hi - 1
            if will_draft:
                ready.append(i)
                last_rows.append(sum(map(len, tokens)) - 1)
        if not requests:
            return [], None, None
        post, nxt = self._forward(requests, tokens, positions, torch.cat(hidden))
        if not self.shares_target_pool:
            for seq_id in requests:
                restore[seq_id] = self.cache.num_tokens(seq_id, self.pool)
        if not ready:
            return [], None, None
        index = torch.tensor(last_rows, dtype=torch.long, device=post.device)
        return ready, post[index], nxt[index]

    def _prepare_rows(self, request: Hashable, lo: int, restore) -> None:
        """Make the draft KV end at hidden index ``lo`` before rows ``lo..`` are (re)written."""
        if self.shares_target_pool:
            # The target's pool: never shrink it, only remember its length to restore after drafting.
            restore.setdefault(request, self.cache.num_tokens(request, self.pool))
            return
        want = lo + self.position_offset
        have = self.cache.num_tokens(request, self.pool)
        if have > want:
            self.cache.truncate(request, want, [self.pool])
        elif have < want:
            raise RuntimeError(
                f"draft pool {self.pool!r} holds {have} rows of request {request!r}, expected {want}: "
                "something truncated it below the draft's verified rows"
            )

    def _chain(self, seqs, limits, post, nxt, ready, drafts, batch_size):
        """Draft up to ``limits[r]`` tokens per ready request from its last catch-up row."""
        draft, k = self.draft, self.num_speculative_tokens
        sampled = not all(s.params.greedy for s in seqs)
        batch, probs = None, None  # all-greedy steps draft the argmax and need neither
        if sampled:
            batch = SamplingBatch.for_sequences(seqs, self.device)
            probs = torch.zeros(batch_size, k, draft.vocab_size, dtype=torch.float64, device=self.device)
        rows = list(range(len(seqs)))  # rows of ``batch`` still drafting
        step = 0
        while True:
            tokens, q = self._draw(draft.compute_logits(post), batch, step, sampled)
            token_list = tokens.tolist()
            for r, token in zip(rows, token_list):
                drafts[ready[r]].append(token)
            if q is not None:
                probs[torch.tensor([ready[r] for r in rows]), step] = q.to(torch.float64)
            step += 1
            keep = [n for n, r in enumerate(rows) if limits[r] > step]
            if not keep:
                return probs
            if len(keep) < len(rows):
                index = torch.tensor(keep)
                batch = batch.select(index) if sampled else None
                nxt = nxt[index.to(nxt.device)]
                token_list = [token_list[n] for n in keep]
            rows = [rows[n] for n in keep]
            off = self.position_offset
            requests = [seqs[r].seq_id for r in rows]
            positions = [[seqs[r].num_tokens - 2 + step + off] for r in rows]
            post, nxt = self._forward(requests, [[t] for t in token_list], positions, nxt)

    def _draw(self, draft_logits: torch.Tensor, batch: SamplingBatch | None, step: int, sampled: bool):
        """Draft target ids for one position and, when any row samples, their q over the target vocab."""
        argmax = self.draft.draft_to_target(greedy_ids(draft_logits))
        if not sampled:
            return argmax, None
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
        """One draft forward over a varlen batch of (tokens, positions, hidden) per request."""
        meta = self._metadata(requests, positions)
        ctx = ForwardContext(self.backend, self.cache, {self.pool: meta})
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long, device=self.device)
        pos = torch.tensor([p for ps in positions for p in ps], dtype=torch.long, device=self.device)
        return self.draft(ids, pos, hidden, ctx)

    def _metadata(self, requests, positions) -> AttentionMetadata:
        """Metadata for contiguous query ``positions[i]`` of each request in the draft's pool.

        Slots come from the pool's block table at the draft's own positions, which is what both homes
        need: the own pool grows by exactly these rows, and in the target's MLA pool draft position p
        is the target's slot for p (pages past the target's length are reserved by the scheduler).
        A sequence that starts past 0 in the pool (``PagedKVCache.set_start``, an unshifted draft
        sharing the prompt's KV) holds positions from its start, so pages are indexed from there.
        """
        cache, pool = self.cache, self.pool
        bs = cache.pool(pool).block_size
        slots, query_lens, seq_lens = [], [], []
        for request, pos in zip(requests, positions):
            end = pos[-1] + 1
            have = cache.num_tokens(request, pool)
            if end > have:
                cache.append_slots(request, end - have, [pool])
            table = cache.block_table(request, pool)
            first = cache.sequence_start(request, pool)
            slots += [table[(p - first) // bs] * bs + (p - first) % bs for p in pos]
            query_lens.append(len(pos))
            seq_lens.append(end - first)
        return AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=cache.block_tables(requests, pool).to(self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_size=bs,
        )

    # ----- feedback -----
    def on_step(self, feedback: StepFeedback) -> None:
        """Keep the fused target states of every verified row of the step (accepted drafts included)."""
        if self.draft is None:
            return
        aux = feedback.target_output.aux_hidden_states
        take: list[tuple[Hashable, int, int]] = []  # (request, first position, rows)
        index: list[int] = []
        for i, seq in enumerate(feedback.seqs):
            if seq.is_finished:
                continue
            valid = feedback.query_lens[i] - feedback.num_drafts[i] + feedback.num_accepted[i]
            if valid <= 0:
                continue
            take.append((seq.seq_id, feedback.start_positions[i], valid))
            index.extend(range(feedback.row_starts[i], feedback.row_starts[i] + valid))
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
            if start != 0:
                raise RuntimeError(
                    f"EAGLE3 proposer got target states of request {request!r} from position {start} without "
                    "the earlier ones; a preempted request must be freed (proposer.free) and recomputed"
                )
            boot = self._bootstrap_hidden()
            off = self.position_offset
            rows = hidden if boot is None else torch.cat([boot.to(hidden.dtype), hidden])
            self._states[request] = _RequestState(rows, -off, -off)
            return
        if start > state.known:
            raise RuntimeError(
                f"EAGLE3 proposer is missing target states of request {request!r} for positions "
                f"{state.known}..{start - 1}"
            )
        if start < state.known:
            # Rows recomputed by the target (never in the current engine): theirs replace ours.
            if start < max(state.hidden_start, state.done - 1):
                raise RuntimeError(
                    f"EAGLE3 proposer: request {request!r} recomputed position {start}, before rows the draft "
                    "already consumed; free the request first"
                )
            state.hidden = state.hidden[: start - state.hidden_start]
            state.done = min(state.done, start)
        state.hidden = torch.cat([state.hidden, hidden])

    def free(self, request: Hashable) -> None:
        self._states.pop(request, None)
