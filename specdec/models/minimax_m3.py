"""MiniMax-M3 text model (``minimax_m3_vl_text``, and the language part of ``minimax_m3_vl``).

Per layer: GQA attention with per-head Gemma-style (``1 + weight``) QK norm and partial RoPE; either
full causal attention or, on ``minimax_m3_sparse`` layers, block-sparse attention chosen by a
lightning indexer; then a dense SwiGLU-OAI MLP or a sigmoid-routed MoE with a shared expert
(``mlp_layer_types``). All norms are Gemma-style.

Block-sparse attention, as the reference defines it: the indexer projects each token to
``index_n_heads`` query vectors and one key vector (RMSNorm + RoPE, no value path). Query ``t``
scores every visible key by dot product, keys are max-pooled into ``index_block_size``-token blocks
anchored at cache position 0, the ``index_local_blocks`` blocks ending at the query's own block are
always kept, and the ``index_topk_blocks`` best blocks (local ones included) are attended. Each
indexer head makes its own choice for a contiguous group of attention heads.

Cache layout (two pools, same page size): ``prefix`` is an ordinary attention pool with every
layer's K/V; ``prefix + ".index"`` holds the indexer keys of the sparse layers only (entry ``"k"``,
``[index_head_dim]`` per token), written and read back through the attention context. Selection
always reads the cached indexer keys, so prefill, chunked prefill, decode and verify choose blocks
identically. Pages must be ``index_block_size`` tokens (128 for the released model), the page size
the deployment kernel needs; :meth:`kv_pools` rejects any other. The selected blocks are the
attention's ``key_mask``: the context turns them into a per-query ``custom_mask``, one backend call
per indexer head group, so any backend with ``custom_mask`` support runs it exactly. A forward whose
requests all hold at most ``index_topk_blocks`` blocks keeps every block, so the indexer only writes
its keys there and the layer attends causally (the zoo model's 8 blocks of 128 cover 1024 tokens:
its forwards take 16-19% less time at 1 and 16 requests, decode and verify alike).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from specdec.backends import invariance, ragged
from specdec.backends.base import AttentionMetadata
from specdec.backends.fixed_split import fixed_split_scores
from specdec.cache.pool import KVPool, PagedPool
from specdec.models.attention import GQASelfAttention
from specdec.models.base import AttentionContext
from specdec.models.decoder import DecoderModel, DecoderOnlyLM, PreNormDecoderLayer
from specdec.models.dims import rotary_dim_of
from specdec.distributed import parallel_state as ps
from specdec.models.layers import Linear, RMSNorm, RotaryEmbedding, compute_dtype, gated_projections
from specdec.models.parallel import ColumnParallelLinear
from specdec.models.minimax_m2 import is_mtp_tensor
from specdec.models.moe import FusedExperts, expert_slice, sigmoid_topk_routing
from specdec.models.weights import SliceTarget

SPARSE_LAYER = "minimax_m3_sparse"
FULL_LAYER = "full_attention"


def text_config_of(config):
    """The language-model config: ``text_config`` of a ``minimax_m3_vl`` checkpoint, else the config."""
    if config.model_type == "minimax_m3_vl":
        return config.text_config
    return config


def _per_layer(config, key: str, allowed: tuple[str, ...], default: str) -> list[str]:
    values = getattr(config, key, None) or [default] * config.num_hidden_layers
    if len(values) != config.num_hidden_layers:
        raise ValueError(
            f"config.{key} has {len(values)} entries for {config.num_hidden_layers} layers; give one per layer"
        )
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ValueError(f"unsupported {key} {unknown} for MiniMax-M3; expected one of {list(allowed)}")
    return list(values)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``.

    The gate half comes first (halves, not interleaved); only the gate's upper side is clamped.
    """
    half = gate_up.shape[-1] // 2
    gate = gate_up[..., :half].clamp(max=limit)
    up = gate_up[..., half:].clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * invariance.sigmoid(gate * alpha))


def rotate_prefix(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int) -> torch.Tensor:
    """NeoX RoPE on the first ``width`` channels of ``x [T, heads, D]`` using the first ``width``
    columns of the duplicated ``[cos, cos]`` table (``cos``/``sin`` are ``[T, rotary_dim]``, as
    :meth:`RotaryEmbedding.cos_sin` gives them).

    This is the reference's indexer rotation: it slices the main attention's table to its own head
    size, which equals ordinary partial RoPE whenever ``index_head_dim >= rotary_dim``.
    """
    cos, sin = cos[:, None, :width], sin[:, None, :width]
    rot, rest = x[..., :width], x[..., width:]
    half = width // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class MiniMaxM3DenseMLP(nn.Module):
    """Fused ``gate_up_proj`` then SwiGLU-OAI then ``down_proj`` (dense layers and the shared expert).

    The checkpoint may hold ``gate_up_proj`` whole or split into ``gate_proj`` / ``up_proj``; the
    :class:`PackedLinear` loads either.
    """

    def __init__(self, config, intermediate_size: int):
        super().__init__()
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.gate_up_proj, self.down_proj = gated_projections(config.hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai(self.gate_up_proj(x), self.alpha, self.limit))


class MiniMaxM3Router(Linear):
    """Router logits (a linear layer, so it serves prepacked too) and the score-correction bias
    (``mlp.gate.*`` in the checkpoint)."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.num_local_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_local_experts), requires_grad=False)


class MiniMaxM3SparseMoeBlock(nn.Module):
    """``routed_scaling_factor * sum_k w_k expert_k(x) + shared_experts(x)``."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.routed_scaling_factor = config.routed_scaling_factor
        alpha, limit = config.swiglu_alpha, config.swiglu_limit
        self.gate = MiniMaxM3Router(config)
        self.experts = FusedExperts(
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            lambda gate_up: swiglu_oai(gate_up, alpha, limit),
            top_k=self.top_k,
        )
        self.shared_experts = MiniMaxM3DenseMLP(config, config.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, experts = sigmoid_topk_routing(logits, self.gate.e_score_correction_bias, self.top_k)
        return self.experts(x, experts, weights).to(x.dtype) * self.routed_scaling_factor + self.shared_experts(x)


class MiniMaxM3Indexer(nn.Module):
    """Lightning indexer: picks, per query and indexer head, the key blocks the attention may read."""

    def __init__(self, config):
        super().__init__()
        # Indexer heads split over the ranks with the attention heads they serve; its one key is whole.
        self.num_heads = ps.current().shard(config.index_n_heads, "index_n_heads")
        self.head_dim = config.index_head_dim
        self.block_size = config.index_block_size
        self.topk_blocks = config.index_topk_blocks
        self.local_blocks = config.index_local_blocks
        if self.topk_blocks < max(self.local_blocks, 1):
            raise ValueError(
                f"index_topk_blocks ({self.topk_blocks}) must be >= 1 and >= index_local_blocks "
                f"({self.local_blocks}): the always-kept local blocks count against the top-k"
            )
        self.q_proj = ColumnParallelLinear(config.hidden_size, config.index_n_heads * self.head_dim, bias=False)
        self.k_proj = Linear(config.hidden_size, self.head_dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, unit_offset=True)
        self.pool: str | None = None  # the ``.index`` pool, bound by kv_pools()
        self.pool_layer = -1

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor | None:
        """Write this step's indexer keys, then return the keep mask ``[T, index_n_heads, max_seq_len]``;
        None when no request holds more than ``index_topk_blocks`` blocks of keys: every query then keeps
        every block it can see, so the mask is the causal one and scoring would change nothing."""
        n = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(n, 1, self.head_dim))
        cos, sin = rotary.cos_sin(positions, k.dtype)
        width = min(self.head_dim, rotary.rotary_dim)
        k = rotate_prefix(k, cos, sin, width)
        ctx.write(self.pool, self.pool_layer, {"k": k[:, 0]})  # later steps' choices read these keys
        meta = ctx.pool_metadata(self.pool)
        if meta.max_seq_len <= self.topk_blocks * self.block_size:
            return None
        q = rotate_prefix(self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim)), cos, sin, width)
        keys = ctx.gather(self.pool, self.pool_layer, "k")  # [B, S, D]: the cached keys, this step's included
        request, offset, query_pos = query_layout(meta)
        scores = self.block_scores(q, keys, meta, request, offset, query_pos)
        return self.select_blocks(scores, query_pos, meta.max_seq_len)

    def block_scores(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        meta: AttentionMetadata,
        request: torch.Tensor,
        offset: torch.Tensor,
        query_pos: torch.Tensor,
    ) -> torch.Tensor:
        """Max over each block's visible keys of ``q . k``: ``[T, H_idx, num_blocks]`` (-inf = unseen)."""
        dtype = compute_dtype(q.dtype)
        seq = keys.shape[1]
        if invariance.enabled():
            scores = fixed_split_scores(q.to(dtype), keys.to(dtype), meta)  # [T, H, S], fixed-shape GEMMs
        else:
            scores = self._padded_scores(q.to(dtype), keys.to(dtype), meta, request, offset)
        future = torch.arange(seq, device=q.device)[None, :] > query_pos[:, None]
        scores = scores.masked_fill(future[:, None, :], float("-inf"))
        num_blocks = -(-seq // self.block_size)
        scores = F.pad(scores, (0, num_blocks * self.block_size - seq), value=float("-inf"))
        return scores.view(*scores.shape[:2], num_blocks, self.block_size).amax(dim=-1)

    def _padded_scores(
        self, q: torch.Tensor, keys: torch.Tensor, meta: AttentionMetadata, request: torch.Tensor, offset: torch.Tensor
    ) -> torch.Tensor:
        """``q . k`` for every query and key of its request, ``[T, H, S]``. Queries are padded per request,
        so the product is ``[B, Q, H, S]`` rather than ``[T, S, D]``; a batch mixing a prompt with
        decoding requests is padded group by group (:mod:`specdec.backends.ragged`)."""
        groups = ragged.query_groups(meta)
        if groups is None:
            return self._padded_product(q, keys, meta.max_query_len, request, offset)
        scores = q.new_zeros(q.shape[0], self.num_heads, keys.shape[1])  # keys past a group's reach: masked later
        for group in groups:
            sub = group.meta
            sub_request, sub_offset, _ = query_layout(sub)
            scores[group.tokens, :, : sub.max_seq_len] = self._padded_product(
                q[group.tokens], keys[group.requests, : sub.max_seq_len], sub.max_query_len, sub_request, sub_offset
            )
        return scores

    def _padded_product(
        self, q: torch.Tensor, keys: torch.Tensor, max_query_len: int, request: torch.Tensor, offset: torch.Tensor
    ) -> torch.Tensor:
        batch = keys.shape[0]
        if q.shape[0] == batch * max_query_len:  # every request has max_query_len queries: views, no copies
            product = torch.einsum("bqhd,bsd->bqhs", q.view(batch, max_query_len, self.num_heads, self.head_dim), keys)
            return product.flatten(0, 1)
        padded = q.new_zeros(batch, max_query_len, self.num_heads, self.head_dim)
        padded[request, offset] = q
        return torch.einsum("bqhd,bsd->bqhs", padded, keys)[request, offset]

    def select_blocks(self, block_scores: torch.Tensor, query_pos: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """Local blocks plus the best-scoring others, ``index_topk_blocks`` in all, as a key mask
        ``[T, H_idx, max_seq_len]``."""
        num_heads, num_blocks = block_scores.shape[1:]
        if self.local_blocks:
            own = query_pos // self.block_size
            local = (own[:, None] - torch.arange(self.local_blocks, device=own.device)).clamp(min=0)
            block_scores = block_scores.scatter(-1, local[:, None, :].expand(-1, num_heads, -1), float("inf"))
        best = block_scores.topk(min(self.topk_blocks, num_blocks), dim=-1)
        chosen = torch.zeros_like(block_scores, dtype=torch.bool)
        chosen.scatter_(-1, best.indices, best.values > float("-inf"))
        return chosen.repeat_interleave(self.block_size, dim=-1)[..., :max_seq_len]


def query_layout(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query token: its request, its offset among that request's queries, its cache position."""
    return meta.derived("minimax_m3.query_layout", _compute_query_layout)


def _compute_query_layout(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = meta.seq_lens.device
    query_lens = meta.query_lens.long()
    request = torch.repeat_interleave(torch.arange(meta.num_requests, device=device), query_lens)
    offset = torch.arange(meta.num_query_tokens, device=device) - meta.query_start_loc[:-1].long()[request]
    position = meta.seq_lens.long()[request] - query_lens[request] + offset
    return request, offset, position


class MiniMaxM3Attention(GQASelfAttention):
    """GQA attention with per-head Gemma QK norm and partial RoPE; block-sparse when it has an indexer."""

    def __init__(self, config, layer_idx: int, sparse: bool):
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, unit_offset=True)
        self.indexer = MiniMaxM3Indexer(config) if sparse else None
        if sparse:
            self._check_head_groups(self.indexer.num_heads)

    def _check_head_groups(self, index_heads: int) -> None:
        # Each indexer head serves a contiguous group of query heads, which must not split a KV head's
        # group unevenly: one group per KV head (the released model), or several of either per other.
        per_group = self.num_heads // index_heads if self.num_heads % index_heads == 0 else 0
        per_kv = self.num_heads // self.num_kv_heads
        if not per_group or (per_group % per_kv and per_kv % per_group):
            raise ValueError(
                f"index_n_heads ({index_heads}) must divide num_attention_heads ({self.num_heads}) into groups "
                f"that align with the {self.num_kv_heads} KV heads (e.g. index_n_heads = num_key_value_heads)"
            )

    def key_mask(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor | None:
        """The indexer's block choice on sparse layers (``[T, index_n_heads, max_seq_len]``); None on full
        layers and where the indexer keeps every block."""
        return None if self.indexer is None else self.indexer(x, positions, rotary, ctx)


class MiniMaxM3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int, sparse_attention: bool, moe: bool):
        super().__init__()
        self.self_attn = MiniMaxM3Attention(config, layer_idx, sparse_attention)
        self.mlp = MiniMaxM3SparseMoeBlock(config) if moe else MiniMaxM3DenseMLP(config, config.dense_intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, unit_offset=True)


_VISION_PREFIXES = (
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
    "patch_merge_mlp.",
)
_LANGUAGE_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_INDEXER_PARTS = re.compile(r"\.self_attn\.index_(q_proj|k_proj|q_norm|k_norm)\.")


class MiniMaxM3ForCausalLM(DecoderOnlyLM):
    """MiniMax-M3 causal LM implementing :class:`specdec.models.CausalLM`.

    Serves ``minimax_m3_vl_text`` checkpoints and the text part of ``minimax_m3_vl``
    (``MiniMaxM3SparseForConditionalGeneration``) ones, whose vision tensors are skipped.
    """

    def __init__(self, config):
        if config.model_type not in ("minimax_m3_vl_text", "minimax_m3_vl"):
            raise ValueError(
                "MiniMaxM3ForCausalLM serves model_type 'minimax_m3_vl_text' or 'minimax_m3_vl', "
                f"got {config.model_type!r}"
            )
        text = text_config_of(config)
        attention_types = _per_layer(text, "layer_types", (FULL_LAYER, SPARSE_LAYER), FULL_LAYER)
        mlp_types = _per_layer(text, "mlp_layer_types", ("sparse", "dense"), "sparse")
        layers = (
            MiniMaxM3DecoderLayer(text, i, attention_types[i] == SPARSE_LAYER, mlp_types[i] == "sparse")
            for i in range(text.num_hidden_layers)
        )
        model = DecoderModel(text, layers, RotaryEmbedding(text, rotary_dim_of(text)), norm_unit_offset=True)
        super().__init__(config, model, text_config=text)
        self.text_config = text
        self.is_multimodal = config.model_type == "minimax_m3_vl"
        self.attention_types = attention_types
        self.mlp_types = mlp_types
        self.required_block_size: int | None = text.index_block_size
        self.needs_custom_mask = SPARSE_LAYER in attention_types

    # ----- cache -----
    def kv_pools(self, prefix: str, block_size: int, dtype: torch.dtype) -> list[KVPool]:
        """``prefix``: every layer's K/V; ``prefix + ".index"``: the sparse layers' indexer keys."""
        if block_size != self.required_block_size:
            raise ValueError(
                f"MiniMax-M3's block-sparse attention needs {self.required_block_size}-token KV pages "
                f"(index_block_size), got block_size={block_size}; use block_size={self.required_block_size}"
            )
        pools = super().kv_pools(prefix, block_size, dtype)
        sparse = [layer.self_attn for layer in self.model.layers if layer.self_attn.indexer is not None]
        if sparse:
            index_pool = prefix + ".index"
            pools.append(
                PagedPool(
                    index_pool,
                    num_layers=len(sparse),
                    block_size=block_size,
                    dtype=dtype,
                    entries={"k": (self.text_config.index_head_dim,)},
                )
            )
            for j, attn in enumerate(sparse):
                attn.indexer.pool, attn.indexer.pool_layer = index_pool, j
        return pools

    # ----- weights -----
    def _checkpoint_name(self, name: str) -> str | SliceTarget | None:
        if is_mtp_tensor(name):
            return None
        if self.is_multimodal:
            if name.startswith(_VISION_PREFIXES):
                return None  # language-model-only serving
            for old, new in _LANGUAGE_PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
        name = self._common_checkpoint_name(name)
        if name is None:
            return None
        # Hub spellings (what the original checkpoint and a minimax_m3_vl save_pretrained write).
        name = name.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = _INDEXER_PARTS.sub(r".self_attn.indexer.\1.", name)
        text = self.text_config
        sliced = expert_slice(name, text.num_local_experts, text.intermediate_size)
        if sliced is not None:
            return sliced
        return name
