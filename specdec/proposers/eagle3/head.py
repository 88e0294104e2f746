"""What every EAGLE3 draft shares, whatever its attention: the aux fusion, the norms, the vocab map.

A draft step (FACTS.md section 3)::

    h0      = fc(fc_norm_i(aux_i) ...)           # first step only: fuse the target's aux states
    x       = cat([input_layernorm(embed(tok)), hidden_norm(h)])      # width 2H
    h'      = residual + self_attn(x)            # residual = h, or hidden_norm(h) (norm_before_residual)
    h'      = h' + mlp(post_attention_layernorm(h'))
    logits  = lm_head(norm(h'))                  # over the draft vocabulary
    next h  = h' (pre-norm), or norm(h') with norm_output (EAGLE3.1)

Subclasses supply the decoder layer's ``self_attn`` (MHA or MLA) and the cache pools.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from specdec.cache.pool import KVPool
from specdec.models.base import AttentionContext
from specdec.distributed import parallel_state as ps
from specdec.models.layers import Linear, PrepackedLMHead, RMSNorm, RotaryEmbedding
from specdec.models.parallel import ShardSpec, VocabParallelEmbedding, VocabParallelHead, padded_vocab
from specdec.proposers.eagle3.config import Eagle3DraftConfig


class Eagle3DecoderLayer(nn.Module):
    """The one decoder layer; names mirror the checkpoints' ``midlayer.*`` keys."""

    def __init__(self, config: Eagle3DraftConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.hidden_norm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.norm_before_residual = config.norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.self_attn(x, positions, rotary, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(PrepackedLMHead, nn.Module):
    """Base of the MHA and MLA drafts: everything but the attention (see the package docstring).

    ``own_embedding`` / ``own_lm_head`` say whether the checkpoint carries those tensors; otherwise
    :meth:`share_target` points them at the target's. ``d2t`` (int64 offsets, ``target_id = draft_id +
    d2t[draft_id]``) and ``t2d`` (bool over the target vocabulary) are buffers the loader fills.
    """

    is_mla = False
    num_layers = 1
    # What the cache set-up asks of any paged model (specdec.models.base.PagedModel): any page size,
    # plain causal attention.
    required_block_size: int | None = None
    needs_custom_mask: bool = False

    def __init__(
        self,
        config: Eagle3DraftConfig,
        *,
        aux_layer_ids: tuple[int, ...],
        target_hidden_size: int,
        own_embedding: bool,
        own_lm_head: bool,
        shard_layer: bool = True,
    ):
        super().__init__()
        self.config = config
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.hidden_size = config.hidden_size
        self.target_hidden_size = target_hidden_size
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = config.draft_vocab_size
        self.norm_output = config.norm_output
        hidden, eps, n = config.hidden_size, config.rms_norm_eps, len(self.aux_layer_ids)
        self.fc = Linear(n * target_hidden_size, hidden, bias=False)
        # Checkpoint names: fc_norm.{i}.weight (EAGLE3.1) and input_norm.weight (norm_before_fc).
        self.fc_norm = nn.ModuleList(RMSNorm(target_hidden_size, eps=eps) for _ in range(n)) if config.fc_norm else None
        self.input_norm = RMSNorm(n * target_hidden_size, eps=eps) if config.norm_before_fc else None
        # Under tensor parallelism the decoder layer is split over the ranks like a target layer, or
        # whole on every rank with whole embeddings (no collectives before the LM head); the LM head's
        # vocabulary is split either way.
        self.shard_layer = shard_layer
        with contextlib.nullcontext() if shard_layer else ps.replicated():
            self.midlayer = self._build_layer(config)
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden) if own_embedding else None
        self.norm = RMSNorm(hidden, eps=eps)
        self.lm_head = VocabParallelHead(hidden, config.draft_vocab_size) if own_lm_head else None
        self.bind_vocab_group()
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = self._build_rotary(config)
        # Set by share_target when the checkpoint has no embedding / lm_head of its own. Plain
        # attributes (a bound method, a detached tensor), so the target's weights are neither copied
        # nor registered as this module's parameters.
        self._target_embed = None
        self._shared_lm_head: torch.Tensor | None = None

    # ----- subclass hooks -----
    def _build_layer(self, config: Eagle3DraftConfig) -> Eagle3DecoderLayer:
        raise NotImplementedError

    def _build_rotary(self, config: Eagle3DraftConfig) -> RotaryEmbedding:
        raise NotImplementedError

    # ----- pools -----
    def kv_pools(self, prefix: str, block_size: int, dtype: torch.dtype) -> list[KVPool]:
        """A single-layer pool named ``prefix`` of the draft's own, laid out as its attention keeps KV
        (K/V heads, or an MLA latent); binds the attention to it. Any page size: the draft is indexed
        by its own block tables."""
        pool = self.midlayer.self_attn.kv_pool(prefix, num_layers=1, block_size=block_size, dtype=dtype)
        self.bind_pool(pool, 0)
        return [pool]

    def bind_pool(self, pool: KVPool, layer_index: int) -> None:
        """Keep the draft's KV in layer ``layer_index`` of ``pool``."""
        attn = self.midlayer.self_attn
        attn.pool, attn.layer_idx = pool.name, layer_index

    # ----- target sharing -----
    def share_target(self, target, target_output_weight: torch.Tensor | None) -> None:
        """Use the target's embedding (if the draft has none) and its output rows (if no lm_head).

        ``target_output_weight`` is the target's ``[vocab, H]`` output projection; the draft keeps the
        rows of its own vocabulary (``draft_to_target(arange(draft_vocab))``), a view when that is all.
        Under tensor parallelism both are this rank's rows of their (padded) vocabularies: the draft's
        rows are picked from every rank's target rows, gathered once here.
        """
        if self.embed_tokens is None:
            self._target_embed = target.embed
            if self.vocab_group.size > 1 and not self.shard_layer:
                # A layer whole on every rank reads whole embeddings: look the table up once (one
                # all-reduce) so a draft step sends nothing but its (max, id) pairs.
                table = target.embed(torch.arange(self.vocab_size, device=self.d2t.device))
                self._target_embed = functools.partial(F.embedding, weight=table)
        if self.lm_head is None:
            ids = self.draft_to_target(torch.arange(self.draft_vocab_size, device=self.d2t.device))
            weight = target_output_weight.detach()
            if ids.numel() == self.vocab_size and bool((ids == torch.arange(ids.numel(), device=ids.device)).all()):
                self._shared_lm_head = weight  # the same vocabulary, split the same way
            else:
                tp = self.vocab_group
                full = ps.all_gather(tp, weight, dim=0)[: self.vocab_size] if tp.size > 1 else weight
                rows = full[ids.to(weight.device)]
                self._shared_lm_head = ShardSpec(0, tp.rank, tp.size, padded_vocab(self.draft_vocab_size)).take(rows)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self._shared_lm_head

    # ----- forward -----
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (target vocabulary ids), the draft's own or the target's."""
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        if self._target_embed is None:
            raise RuntimeError(
                "the draft has no embedding of its own and was not given the target's: use load_eagle3_draft"
            )
        return self._target_embed(input_ids).to(self.fc.weight.dtype)

    def combine_aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse the target's captured states ``[T, n * H_target]`` (ascending layer order) into ``[T, H]``."""
        expected = self.fc.in_features
        if aux_hidden.shape[-1] != expected:
            raise ValueError(
                f"aux hidden states are {aux_hidden.shape[-1]} wide, the draft's fc takes {expected} "
                f"({len(self.aux_layer_ids)} aux layers x target hidden {self.target_hidden_size}); capture "
                f"aux_layer_ids={self.aux_layer_ids} in the target forward"
            )
        x = aux_hidden.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            chunks = x.split(self.target_hidden_size, dim=-1)
            x = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(x)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over a flattened varlen batch.

        ``hidden [T, H]`` is ``combine_aux(target aux)`` at positions that have the target's states,
        else the ``next_hidden`` this method returned for the previous position. Returns
        ``(logits_hidden, next_hidden)``: the post-norm state for :meth:`compute_logits`, and the state
        to feed back (pre-norm; post-norm with ``norm_output``).
        """
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden is {hidden.shape[-1]} wide, the draft takes {self.hidden_size}: pass combine_aux(aux) "
                "or the draft's own next_hidden"
            )
        h = self.midlayer(self.embed(input_ids), hidden, positions, self.rotary, ctx)
        post = self.norm(h)
        return post, (post if self.norm_output else h)

    @property
    def output_vocab_size(self) -> int:
        return self.draft_vocab_size

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[T, draft_vocab_size]`` of post-norm states."""
        return super().compute_logits(hidden_states)

    def output_weight(self) -> torch.Tensor:
        return self.lm_head_weight

    # ----- vocabulary -----
    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft-vocabulary ids (``id + d2t[id]``)."""
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter ``[T, draft_vocab]`` logits into ``[T, vocab]``, ``-inf`` where the draft has no token."""
        ids = self.draft_to_target(torch.arange(self.draft_vocab_size, device=draft_logits.device))
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., ids] = draft_logits
        return out
