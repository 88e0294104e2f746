"""The Proposer protocol: how a drafting strategy plugs into the engine step.

One engine step with speculation (``specdec.engine.engine`` says which phase writes the cache)::

    drafts = proposer.propose(seqs, max_drafts)      # up to k per request, maybe with q
    target forward over every request's new tokens + drafts (k+1 verify rows each)
    verifier accepts a prefix of each request's drafts and emits one more token
    the engine truncates the target's and the proposer's own pools to the verified length
    proposer.on_step(feedback)                        # keep what it needs, forget released requests

A proposer owns its own state (a draft model's KV pool in the shared cache, hidden states it kept from
the last target forward) and keeps it consistent with what was accepted. ``setup`` declares the pools
it uses (:class:`ProposerPools`); during ``propose`` it may append to its own pools, and rows it keeps
only for the proposal go in a :meth:`~specdec.cache.paged_cache.PagedKVCache.scratch` scope.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Protocol, Sequence, runtime_checkable

import attrs
import torch
from torch import nn

from specdec.models.quantization import quantize_weights
from specdec.proposers.options import DEFAULT_DRAFT_SAMPLE_METHOD, ModelOptions, keys_from

if TYPE_CHECKING:
    from specdec.backends.base import AttentionBackend
    from specdec.cache.paged_cache import PagedKVCache
    from specdec.cache.pool import PagedPool
    from specdec.models.base import CausalLM, ModelOutput
    from specdec.runtime.layout import StepLayout
    from specdec.runtime.sequence import Sequence as EngineSequence


@attrs.frozen
class Proposal:
    """Drafts for one step, one entry per request passed to :meth:`Proposer.propose`.

    ``draft_token_ids[i]`` holds 0..``max_drafts[i]`` token ids. ``draft_probs`` is None for a
    deterministic drafter (n-gram, greedy draft model: q is one-hot at the draft), else a float
    tensor ``[B, k, V]`` whose row ``[i, j]`` is the distribution draft ``j`` of request ``i`` was
    sampled from (after the request's temperature / top-k / top-p, as ``target_probs`` gives it);
    rows past a request's drafts are ignored. It picks the engine's verifier for a sampling step:
    the coupled one without it (plain sampling's tokens), rejection sampling with it (the law).
    """

    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None = None


@attrs.frozen
class ProposerPools:
    """The cache pools a proposer uses, as its :meth:`Proposer.setup` declares them.

    - ``backend``: the attention backend its layers run on (None: it runs no attention).
    - ``own``: pools it registered; the engine reserves pages in them for every scheduled request
      (its tokens + k), truncates them to the verified length after each step and frees them with
      the request.
    - ``joined``: target pools it added layers to (an MLA draft living in the target's MLA pool).
    - ``read``: target pools it reads without writing (KV sharing).
    - ``prompt_free``: own pools that hold no prompt positions (the prompt's KV is read from a target
      pool): the engine starts a request's sequence there at its prompt length when it is admitted.

    Prefix caching (the engine's): every pool but the prompt-free ones is cached page by page, keyed by
    the tokens its pages depend on.

    - ``successor_keyed``: own or joined pools whose row ``p`` also depends on token ``p + 1`` (a
      shifted EAGLE3 draft); their page keys include the token after the page.
    - ``reuse_lead``: None when the proposer catches its own pools up from whatever prefix they reuse
      (a draft model); else ``n``: it needs the target's hidden states from the position where the
      target's reuse ends, so the target reuses at most ``own reuse - n`` positions (0 for a shifted
      EAGLE3 draft, 1 for an unshifted one, whose row ``p`` reads ``h_(p-1)``). A proposer reads what
      a request reuses as its pool lengths when the request is first seen (and the first forward's
      start position, the target's reuse).
    - A proposer that joins pools implements ``joined_rows(request) -> int``: positions below it hold
      its final rows there (its rows may trail the target's), so pages are cached no further.
    """

    backend: "AttentionBackend | None" = None
    own: tuple[str, ...] = ()
    joined: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    prompt_free: tuple[str, ...] = ()
    successor_keyed: tuple[str, ...] = ()
    reuse_lead: int | None = None


@attrs.frozen
class StepFeedback:
    """What happened in one engine step, for the proposer to update its state.

    ``seqs[i]`` (tokens already updated with this step's emitted tokens) ran the rows of
    ``layout.requests[i]`` in ``target_output``; of its ``layout.num_drafts[i]`` drafts the first
    ``num_accepted[i]`` were accepted (rows of rejected drafts hold states of tokens that are gone).
    ``target_output.aux_hidden_states`` is set when the proposer asked for ``aux_layer_ids``.
    ``finished`` (done or aborted) and ``preempted`` name the requests released in this step: the
    proposer must forget them (a preempted request comes back later as a new prefill); their pages are
    freed (a finished one's right after this call). A step may release requests without running a
    forward (``layout`` and ``target_output`` None, ``seqs`` empty). ``cache_finished``: the engine
    publishes the finished requests' pages to the prefix cache after this call, so a proposer whose
    rows trail the verified tokens may complete them now. ``dormant``: requests of the step that will
    get no drafts again unless preempted and recomputed (the adaptive controller gave up on them, and
    wakes one that way); a proposer may stop keeping their state (the target captured no aux layers
    when every request of the step is dormant), and their pages stay until they are released.
    """

    seqs: Sequence["EngineSequence"] = ()
    layout: "StepLayout | None" = None
    num_accepted: Sequence[int] = ()
    target_output: "ModelOutput | None" = None
    finished: Sequence[Hashable] = ()
    preempted: Sequence[Hashable] = ()
    cache_finished: bool = False
    dormant: frozenset = frozenset()

    @property
    def released(self) -> tuple[Hashable, ...]:
        """Every request this step released, finished or preempted."""
        return (*self.finished, *self.preempted)


@attrs.frozen
class ProposerContext:
    """What a proposer's setup may need from the engine being built.

    ``target_pools`` are the target model's pools (not yet materialised: an MLA draft may add a
    layer to one of them); ``cache`` is the shared cache the proposer registers its pools in.
    ``dtype`` is the draft's weights' and ``kv_dtype`` what its own pools store (fp8 under
    ``draft_kv_cache_dtype``; layers it adds to a target pool store that pool's dtype).
    """

    target: "CausalLM"
    target_pools: Sequence["PagedPool"]
    cache: "PagedKVCache"
    backend: "AttentionBackend"
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    max_model_len: int


@runtime_checkable
class Proposer(Protocol):
    """A drafting strategy.

    - ``num_speculative_tokens``: k, the most drafts per request per step.
    - ``aux_layer_ids``: target layers whose hidden states (capture-before convention) the engine
      must capture in every target forward and hand to :meth:`on_step`; ``()`` for none.
    """

    num_speculative_tokens: int
    aux_layer_ids: tuple[int, ...]

    def setup(self, context: ProposerContext) -> ProposerPools:
        """Register pools in ``context.cache`` (before it is built), keep what it needs, declare its pools."""
        ...

    def propose(self, seqs: Sequence["EngineSequence"], max_drafts: Sequence[int]) -> Proposal:
        """Draft up to ``max_drafts[i]`` tokens continuing ``seqs[i].token_ids`` (read-only)."""
        ...

    def on_step(self, feedback: StepFeedback) -> None:
        """Called after every step (verification done, pages of released requests freed)."""
        ...


class ProposerBase:
    """Defaults for the optional parts of the protocol: no hidden states, no pools, no state."""

    num_speculative_tokens: int = 1
    aux_layer_ids: tuple[int, ...] = ()

    def setup(self, context: ProposerContext) -> ProposerPools:
        return ProposerPools()

    def on_step(self, feedback: StepFeedback) -> None:
        pass

    def calibration_step(self, requests: Sequence[Hashable]) -> bool:
        """Run one step of the draft chain (a forward over one new token each, and its greedy draw) for
        ``requests``: throwaway requests holding no rows, whose pages the engine frees after. The
        adaptive controller times it at sizes up to ``max_num_seqs`` when the engine starts, for the
        shape of its draft curve by requests (:func:`specdec.engine.calibration.calibrate`). Returns
        whether a forward ran: False (the default) for a proposer without one worth timing."""
        return False


@keys_from(ModelOptions)
class ModelProposer(ProposerBase):
    """A proposer that drafts with a model of its own: the keys of
    :class:`~specdec.proposers.options.ModelOptions`, kept as attributes (``model_path``)."""

    def __init__(
        self,
        model: str,
        num_speculative_tokens: int,
        *,
        attention_backend: str | None = None,
        block_size: int | None = None,
        draft_sample_method: str = DEFAULT_DRAFT_SAMPLE_METHOD,
        quantization: str | None = None,
    ):
        self.model_path = model
        self.num_speculative_tokens = num_speculative_tokens
        self.attention_backend = attention_backend
        self.block_size = block_size
        self.draft_sample_method = draft_sample_method
        self.quantization = quantization

    def quantized(self, draft: nn.Module) -> nn.Module:
        """The loaded ``draft``, its weights quantized by the ``quantization`` key (when given)."""
        if self.quantization is not None:
            quantize_weights(draft, self.quantization)
        return draft

    @property
    def samples_drafts(self) -> bool:
        """Whether sampling requests draw their drafts from q (and report it) rather than take the argmax."""
        return self.draft_sample_method == "probabilistic"
