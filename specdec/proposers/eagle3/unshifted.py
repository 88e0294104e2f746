"""The ``eagle3-unshifted`` proposer: EAGLE3 drafting with an unshifted prefill, optionally on the target's KV.

Positions (FACTS.md section 4, vLLM PR #21008). The shifted draft puts (token ``p + 1``, target hidden
``h_p``) at position ``p``; the unshifted one puts the same pair at position ``p + 1``, so draft
token ``p`` sits at position ``p`` like the target's, plus one row at position 0: (token 0, a
bootstrap hidden). A full prefill of ``N`` tokens runs ``N + 1`` draft rows, positions ``0..N``; a
chunk of a prefill runs the target's own positions; drafting continues one position ahead of the
shifted draft. The EAGLE3 machinery (fc fusion, chain drafting, catch-up from the target's true
hidden states, d2t, sampled q) is :class:`~specdec.proposers.eagle3.proposer.Eagle3Proposer`'s, with
its ``position_offset`` set to 1.

Bootstrap hidden: a zero vector in the fused (post-``fc``) space. It is what this project's trainer
feeds at position 0 (``specdec/train/draft/loss.py``) and the only spelling drafts declare
(``eagle_config.bootstrap_hidden: "zeros"``); no published checkpoint ships a learned one. Zero
also makes the row's hidden half vanish after ``hidden_norm``, so position 0 is driven by its token
alone. Any other declared value is refused rather than guessed. With KV sharing position 0 is a
prompt position, so the bootstrap row is never run.

KV sharing (``kv_sharing=true``, the default): the draft's layer reads a target layer's KV at the
prompt positions ``[0, P)`` (``P`` = the prompt length) and computes its own KV only from position
``P`` on, so its prefill is one row (token ``P``, hidden ``h_(P-1)``) and its pool holds no prompt
pages: the request's draft-pool sequence starts at ``P`` (``PagedKVCache.set_start``). Decode-time
draft KV is its own, recomputed from the target's hidden states after verification as in ``eagle3``.
The target layer is ``kv_sharing_target_layer`` from the speculative config, else the draft
config's ``eagle_config.kv_sharing_target_layers`` (``{"0": layer}``, what it was trained with),
else the last target layer whose KV layout matches the draft's (MHA/GQA heads and dims, or MLA
latent dims); a mismatch is refused. The draft's own KV lives in a pool of its own even for an MLA
draft under an MLA target: its newest true-hidden row sits at the position the target has not
cached yet, which the target's pool cannot keep between steps.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import attrs
import torch

from specdec.distributed import parallel_state as ps
from specdec.models.loader import read_config_json
from specdec.proposers.base import Proposal, ProposerContext, ProposerPools
from specdec.proposers.eagle3.kv_sharing import (
    KVSource,
    SharedKVContext,
    SharedLayer,
    prefix_metadata,
    resolve_shared_layer,
)
from specdec.proposers.eagle3.options import Eagle3Options
from specdec.proposers.eagle3.proposer import Eagle3Proposer
from specdec.proposers.options import DEFAULT_DRAFT_SAMPLE_METHOD, keys_from, option
from specdec.validation import boolean, int_at_least

BOOTSTRAPS = ("zeros",)


@attrs.frozen(kw_only=True)
class UnshiftedOptions(Eagle3Options):
    """``eagle3-unshifted``'s keys: the model-based ones, ``kv_sharing`` (default true) and, with
    sharing, ``kv_sharing_target_layer`` (0-based; default: what the draft was trained to read, else
    the last target layer with the draft's KV layout)."""

    kv_sharing: bool | None = option(bool, boolean(optional=True))
    kv_sharing_target_layer: int | None = option(int, int_at_least(0, optional=True))

    def __attrs_post_init__(self) -> None:
        if self.kv_sharing is None:
            object.__setattr__(self, "kv_sharing", True)  # frozen: filling the default at construction
        if self.kv_sharing_target_layer is not None and not self.kv_sharing:
            raise ValueError(
                "speculative config: kv_sharing_target_layer needs kv_sharing=true (without sharing the draft "
                "reads no target layer); drop it or set kv_sharing=true"
            )


@attrs.frozen
class UnshiftedDraftOptions:
    """What a draft's ``config.json`` says about unshifted serving (all optional).

    ``eagle_config.bootstrap_hidden``: ``"zeros"`` (the default); ``eagle_config.kv_sharing_target_layers``:
    ``{"0": target_layer}``, the layer the draft was trained to read.
    """

    bootstrap: str = "zeros"
    declared_target_layer: int | None = None

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> "UnshiftedDraftOptions":
        eagle = raw.get("eagle_config") or {}
        boot = eagle.get("bootstrap_hidden", "zeros")
        if boot not in BOOTSTRAPS:
            raise ValueError(
                f"draft config: eagle_config.bootstrap_hidden is {boot!r}; supported: {list(BOOTSTRAPS)} "
                "(the zero vector the draft sees at position 0)"
            )
        mapping = eagle.get("kv_sharing_target_layers")
        layer = None
        if mapping is not None:
            if not isinstance(mapping, Mapping) or set(map(str, mapping)) != {"0"}:
                raise ValueError(
                    f"draft config: eagle_config.kv_sharing_target_layers must map the draft's one layer to a "
                    f'target layer, {{"0": layer}}; got {mapping!r}'
                )
            layer = next(iter(mapping.values()))
            if not (isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0):
                raise ValueError(
                    f"draft config: eagle_config.kv_sharing_target_layers gives target layer {layer!r}; "
                    "it must be an int >= 0"
                )
        return cls(bootstrap=boot, declared_target_layer=layer)


@keys_from(UnshiftedOptions)
class UnshiftedEagle3Proposer(Eagle3Proposer):
    """EAGLE3 with unshifted positions; ``kv_sharing`` makes the draft read the target's prompt KV.

    ``kv_sharing_target_layer`` (with sharing only) picks the target layer; see the module docstring
    for the default. ``attention_backend`` / ``block_size`` are the draft's, as for ``eagle3``.
    """

    position_offset = 1
    methods = ("eagle3-unshifted",)
    default_method = "eagle3-unshifted"

    def __init__(
        self,
        model: str,
        num_speculative_tokens: int,
        *,
        kv_sharing: bool | None = None,
        kv_sharing_target_layer: int | None = None,
        attention_backend: str | None = None,
        block_size: int | None = None,
        draft_tensor_parallel_size: int | None = None,
        draft_sample_method: str = DEFAULT_DRAFT_SAMPLE_METHOD,
        quantization: str | None = None,
    ):
        super().__init__(model, num_speculative_tokens, attention_backend=attention_backend, block_size=block_size,
                         draft_tensor_parallel_size=draft_tensor_parallel_size,
                         draft_sample_method=draft_sample_method, quantization=quantization)
        self.kv_sharing = kv_sharing
        self.kv_sharing_target_layer = kv_sharing_target_layer
        self.shared_layer: SharedLayer | None = None
        self._boot: torch.Tensor | None = None

    # ----- setup -----
    def setup(self, context: ProposerContext) -> ProposerPools:
        options = UnshiftedDraftOptions.from_config(read_config_json(self.model_path))
        pools = super().setup(context)
        self._boot = torch.zeros(1, self.draft.hidden_size, dtype=self.draft.fc.weight.dtype, device=self.device)
        if not self.kv_sharing:
            return pools
        requested, declared = self.kv_sharing_target_layer, options.declared_target_layer
        if requested is not None and declared is not None and requested != declared:
            warnings.warn(
                f"kv_sharing_target_layer={requested} overrides the target layer {declared} the draft was trained "
                "to read (eagle_config.kv_sharing_target_layers); expect lower acceptance",
                stacklevel=2,
            )
        self.shared_layer = resolve_shared_layer(
            context.target, context.target_pools, self.draft, requested=requested, declared=declared
        )
        # The prompt's KV is the target's: the draft's own pool starts each request at its prompt length
        # (it holds no prompt pages, so nothing of it is prefix-cached).
        self._completes_finished = False
        return attrs.evolve(pools, read=(self.shared_layer.pool,), prompt_free=pools.own)

    def _shard_layer(self) -> bool:
        if not self.kv_sharing:
            return super()._shard_layer()
        # The draft reads a target layer's KV, of which a rank holds its own heads: split like the target.
        if self.draft_tensor_parallel_size == 1 and ps.current().size > 1:
            raise ValueError(
                "speculative config draft_tensor_parallel_size=1 with kv_sharing: the draft reads a target layer's "
                "KV, which tensor parallelism splits by head; drop draft_tensor_parallel_size or set kv_sharing=false"
            )
        return True

    def _shared_pool(self, draft, target_pools, backend):
        return None  # always a pool of its own (see the module docstring)

    def _bootstrap_hidden(self) -> torch.Tensor | None:
        return self._boot

    # ----- proposing -----
    def propose(self, seqs: Sequence, max_drafts: Sequence[int]) -> Proposal:
        if self.kv_sharing:
            # Until the target has computed every prompt position, the draft's first own row (position
            # P) has no hidden state; such a request (a prompt whose last token is still uncached)
            # waits one plain step instead of drafting from a prompt position.
            max_drafts = [m if seq.num_tokens > seq.num_prompt_tokens else 0 for seq, m in zip(seqs, max_drafts)]
        return super().propose(seqs, max_drafts)

    def _forward(self, requests, tokens, positions, hidden):
        if not self.kv_sharing:
            return super()._forward(requests, tokens, positions, hidden)
        cache, shared = self.cache, self.shared_layer
        meta = self._metadata(requests, positions)
        target_pool = cache.pool(shared.pool)
        source = KVSource(
            shared.pool,
            shared.pool_layer,
            prefix_metadata(
                cache.block_tables(requests, shared.pool).to(self.device),
                [cache.sequence_start(r, self.pool) for r in requests],
                [hi - lo for lo, hi in positions],
                target_pool.block_size,
            ),
        )
        attn = self.draft.midlayer.self_attn
        ctx = SharedKVContext(self.backend, cache, {self.pool: meta}, shared={(attn.pool, attn.layer_idx): source})
        return self.draft(*self._inputs(tokens, positions), hidden, ctx)
