"""The Proposer protocol: how a drafting strategy plugs into the engine step.

One engine step with speculation::

    drafts = proposer.propose(seqs, max_drafts)      # up to k per request, maybe with q
    target forward over every request's new tokens + drafts (k+1 verify rows each)
    verifier accepts a prefix of each request's drafts and emits one more token
    every pool is truncated to the accepted length     # the engine does this for all pools
    proposer.on_step(feedback)                        # roll back / keep the target's hidden states
    proposer.free(request) for finished and preempted requests

A proposer owns its own state (e.g. a draft model's KV pool in the shared cache, hidden states it
kept from the last target forward) and must keep it consistent with what was accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Protocol, Sequence, runtime_checkable

import attrs
import torch

if TYPE_CHECKING:
    from specdec.backends.base import AttentionBackend
    from specdec.cache.paged_cache import PagedKVCache
    from specdec.cache.pool import PagedPool
    from specdec.engine.sequence import Sequence as EngineSequence
    from specdec.models.base import CausalLM, ModelOutput


@attrs.frozen
class Proposal:
    """Drafts for one step, one entry per request passed to :meth:`Proposer.propose`.

    ``draft_token_ids[i]`` holds 0..``max_drafts[i]`` token ids. ``draft_probs`` is None for a
    deterministic drafter (n-gram, greedy draft model: q is one-hot at the draft), else a float
    tensor ``[B, k, V]`` whose row ``[i, j]`` is the distribution draft ``j`` of request ``i`` was
    sampled from (after the request's temperature / top-k / top-p, as ``target_probs`` gives it);
    rows past a request's drafts are ignored.
    """

    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None = None


@attrs.frozen
class StepFeedback:
    """What happened to the requests of one target forward, for the proposer to update its state.

    Request ``i`` (``seqs[i]``, tokens already updated with this step's emitted tokens) ran
    ``query_lens[i]`` target rows starting at row ``row_starts[i]`` of ``target_output`` and at
    position ``start_positions[i]``; its last ``num_drafts[i]`` rows were drafts, of which the first
    ``num_accepted[i]`` were accepted. Rows of rejected drafts hold states of tokens that are gone.
    ``target_output.aux_hidden_states`` is set when the proposer asked for ``aux_layer_ids``.
    Finished requests are included (and freed right after).
    """

    seqs: Sequence["EngineSequence"]
    row_starts: list[int]
    query_lens: list[int]
    start_positions: list[int]
    num_drafts: list[int]
    num_accepted: list[int]
    target_output: "ModelOutput"


@attrs.frozen
class ProposerContext:
    """What a proposer factory may need from the engine being built.

    ``target_pools`` are the target model's pools (not yet materialised: an MLA draft may add a
    layer to one of them); ``cache`` is the shared cache the proposer registers its pools in.
    """

    target: "CausalLM"
    target_pools: Sequence["PagedPool"]
    cache: "PagedKVCache"
    backend: "AttentionBackend"
    dtype: torch.dtype
    device: torch.device
    max_model_len: int


@runtime_checkable
class Proposer(Protocol):
    """A drafting strategy.

    - ``num_speculative_tokens``: k, the most drafts per request per step.
    - ``aux_layer_ids``: target layers whose hidden states (capture-before convention) the engine
      must capture in every target forward and hand to :meth:`on_step`; ``()`` for none.
    - ``pool_names``: the cache pools this proposer registered (none for n-gram). The engine
      reserves pages in every pool of the cache for each scheduled request (its tokens + k) and
      truncates every pool to the request's verified length after each step, so a proposer only
      rolls back state the cache does not hold.
    """

    num_speculative_tokens: int
    aux_layer_ids: tuple[int, ...]
    pool_names: tuple[str, ...]

    def setup(self, context: ProposerContext) -> None:
        """Register pools in ``context.cache`` (before it is built) and keep what it needs."""
        ...

    def propose(self, seqs: Sequence["EngineSequence"], max_drafts: Sequence[int]) -> Proposal:
        """Draft up to ``max_drafts[i]`` tokens continuing ``seqs[i].token_ids`` (read-only)."""
        ...

    def on_step(self, feedback: StepFeedback) -> None:
        """Called after verification with every request of the step."""
        ...

    def free(self, request: Hashable) -> None:
        """Forget a finished or preempted request (its cache pages are already freed)."""
        ...


class ProposerBase:
    """Defaults for the optional parts of the protocol: no hidden states, no pools, no state."""

    num_speculative_tokens: int = 1
    aux_layer_ids: tuple[int, ...] = ()
    pool_names: tuple[str, ...] = ()

    def setup(self, context: ProposerContext) -> None:
        pass

    def on_step(self, feedback: StepFeedback) -> None:
        pass

    def free(self, request: Hashable) -> None:
        pass
