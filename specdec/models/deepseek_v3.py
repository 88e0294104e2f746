"""DeepSeek-V3 class decoders (``deepseek_v3``, ``kimi_k2``): MLA attention and a routed MoE.

Attention is Multi-head Latent Attention. Each token caches one latent row: the normalised compressed
KV (``kv_lora_rank`` columns) followed by the roped shared key part (``qk_rope_head_dim`` columns),
in an :class:`~specdec.cache.MLAPool`. Attention runs in the *absorbed* form: the key half of
``kv_b_proj`` is folded into the query, so queries score the latent rows directly, and the value half
is applied to the attention output. That is algebraically the naive form transformers computes (which
expands per-head keys and values), without ever materialising them.

The MoE is DeepSeek-V3's: a sigmoid router whose ``e_score_correction_bias`` only steers which experts
are chosen (the mixing weights are the unbiased scores), group-limited top-k, optional
renormalisation, ``routed_scaling_factor``, plus always-on shared experts. Layers before
``first_k_dense_replace`` (and those ``moe_layer_freq`` skips) use a dense MLP instead.

The module tree mirrors the checkpoint names transformers writes. Experts are held stacked
(``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``, transformers' in-memory
layout) and load from either that fused layout or the per-expert tensors ``save_pretrained`` and the
hub checkpoints use (``experts.N.{gate,up,down}_proj.weight``). Multi-token-prediction layers
(``model.layers.{num_hidden_layers}+``) are skipped: the engine does not run them.
"""

from __future__ import annotations

import math
import re

import attrs
import torch
from torch import nn
from transformers.activations import ACT2FN

from specdec.backends import invariance
from specdec.backends.base import math_dtype
from specdec.cache.pool import MLAPool
from specdec.models.base import AttentionContext
from specdec.models.decoder import DecoderModel, DecoderOnlyLM, PreNormDecoderLayer, bound_pool
from specdec.distributed import parallel_state as ps
from specdec.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, compute_dtype, linear
from specdec.models.parallel import ColumnParallelLinear, RowParallelLinear
from specdec.models.moe import FusedExperts, expert_slice, gated_activation
from specdec.models.weights import SliceTarget

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")

# transformers (and DeepSeek's own reference code) fix the q/kv latent norms' epsilon at 1e-6,
# whatever the config's rms_norm_eps says.
_LATENT_NORM_EPS = 1e-6


def _positive(instance, attribute, value) -> None:
    if value is None or value <= 0:
        raise ValueError(f"config.{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen
class DeepseekV3Settings:
    """The architecture switches read from a DeepSeek-V3 / Kimi-K2 config, validated once."""

    num_layers: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    num_heads: int = attrs.field(validator=_positive)
    q_lora_rank: int | None
    kv_lora_rank: int = attrs.field(validator=_positive)
    qk_nope_head_dim: int = attrs.field(validator=_positive)
    qk_rope_head_dim: int = attrs.field(validator=_positive)
    v_head_dim: int = attrs.field(validator=_positive)
    attention_bias: bool
    rope_interleave: bool
    softmax_scale: float
    hidden_act: str
    intermediate_size: int = attrs.field(validator=_positive)
    # MoE; num_experts == 0 means every layer is dense.
    num_experts: int
    moe_intermediate_size: int
    num_shared_experts: int
    top_k: int
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int

    def __attrs_post_init__(self) -> None:
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"config.q_lora_rank must be positive or null (no q compression), got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config.qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"unknown hidden_act {self.hidden_act!r}; choose one of {sorted(ACT2FN)}")
        if not self.num_experts:
            return
        if self.moe_intermediate_size <= 0 or self.top_k <= 0:
            raise ValueError(
                "config.moe_intermediate_size and config.num_experts_per_tok must be positive for MoE layers"
            )
        if self.moe_layer_freq <= 0:
            raise ValueError(f"config.moe_layer_freq must be a positive integer, got {self.moe_layer_freq}")
        if self.num_groups <= 0 or self.num_experts % self.num_groups:
            raise ValueError(
                f"config.n_group ({self.num_groups}) must divide n_routed_experts ({self.num_experts})"
            )
        if not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"config.topk_group must be in 1..n_group ({self.num_groups}), got {self.topk_groups}")
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and per_group < 2:
            raise ValueError(
                "group-limited routing scores each group by its top-2 experts: n_routed_experts / n_group "
                f"must be >= 2, got {per_group}; lower n_group"
            )
        if self.top_k > self.topk_groups * per_group:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) exceeds the experts in the topk_group selected groups "
                f"({self.topk_groups * per_group})"
            )

    @classmethod
    def from_hf_config(cls, config) -> "DeepseekV3Settings":
        if getattr(config, "quantization_config", None):
            method = dict(config.quantization_config).get("quant_method", "?")
            raise ValueError(
                f"quantized checkpoints (quant_method {method!r}) are not supported; "
                "use a bfloat16 / float checkpoint (dequantise the weights first)"
            )
        # A missing scoring_func / topk_method is DeepSeek-V3's own routing: transformers hard-codes it
        # and does not write these keys into the configs it saves.
        scoring = getattr(config, "scoring_func", None) or "sigmoid"
        topk_method = getattr(config, "topk_method", None) or "noaux_tc"
        if scoring != "sigmoid" or topk_method != "noaux_tc":
            raise ValueError(
                f"unsupported router scoring_func={scoring!r}, topk_method={topk_method!r}: DeepSeek-V3 / "
                "Kimi-K2 checkpoints route with scoring_func='sigmoid', topk_method='noaux_tc'"
            )
        num_experts = getattr(config, "n_routed_experts", None) or 0
        num_groups = getattr(config, "n_group", None) or 1
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            q_lora_rank=getattr(config, "q_lora_rank", None),
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            rope_interleave=bool(getattr(config, "rope_interleave", True)),
            softmax_scale=mla_softmax_scale(config),
            hidden_act=getattr(config, "hidden_act", "silu"),
            intermediate_size=config.intermediate_size,
            num_experts=num_experts,
            moe_intermediate_size=getattr(config, "moe_intermediate_size", 0) or 0,
            num_shared_experts=getattr(config, "n_shared_experts", None) or 0,
            top_k=getattr(config, "num_experts_per_tok", None) or 0,
            num_groups=num_groups,
            topk_groups=getattr(config, "topk_group", None) or num_groups,
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
            first_k_dense_replace=getattr(config, "first_k_dense_replace", None) or 0,
            moe_layer_freq=getattr(config, "moe_layer_freq", None) or 1,
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """DeepSeek's rule: routed experts from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
        return (
            self.num_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )


def mla_softmax_scale(config) -> float:
    """``1/sqrt(qk_head_dim)``, times ``mscale**2`` for YaRN checkpoints that set ``mscale_all_dim``.

    YaRN's ``attention_factor`` (mscale / mscale_all_dim) already scales the RoPE tables, i.e. only the
    rotary part of q.k; DeepSeek folds the all-dimension factor into the softmax scale instead.
    """
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if rope_type != "default" and mscale_all_dim:
        factor = float(params["factor"])
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class DeepseekV3Attention(nn.Module):
    """MLA whose latent KV lives in layer ``layer_idx`` of an MLA pool; absorbed-form attention."""

    def __init__(self, s: DeepseekV3Settings, layer_idx: int):
        super().__init__()
        self.settings = s  # dims, read by forward
        self.layer_idx = layer_idx
        self.scale = s.softmax_scale
        # Heads split over the ranks (q, the per-head latent maps, o_proj); the latent is every head's,
        # so its projection and cache are whole on every rank.
        self.num_heads = ps.current().shard(s.num_heads, "num_attention_heads")
        heads = s.num_heads
        qk_head_dim = s.qk_nope_head_dim + s.qk_rope_head_dim
        if s.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(s.hidden_size, heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(s.hidden_size, s.q_lora_rank, bias=s.attention_bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, eps=_LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(s.q_lora_rank, heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(
            s.hidden_size, s.kv_lora_rank + s.qk_rope_head_dim, bias=s.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, eps=_LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(s.kv_lora_rank, heads * (s.qk_nope_head_dim + s.v_head_dim), bias=False)
        self.o_proj = RowParallelLinear(heads * s.v_head_dim, s.hidden_size, bias=s.attention_bias)
        self.pool: str | None = None  # bound by the model's kv_pools()
        self.absorbed: tuple[torch.Tensor, torch.Tensor] | None = None  # see prepack_weights

    def absorbed_maps(self, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk [H, nope, rank]`` and ``W_uv [H, v, rank]``: per head, ``kv_b_proj``'s rows are the nope
        key rows then the value rows, each a map from the latent."""
        s = self.settings
        w_kv = kv_b.view(self.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        return w_kv[:, : s.qk_nope_head_dim], w_kv[:, s.qk_nope_head_dim :]

    def prepack_weights(self) -> None:
        """Float32 copies of the absorbed maps for a half type the CPU has no kernels for
        (:func:`~specdec.backends.base.math_dtype`); :func:`specdec.models.layers.prepack_weights` calls it."""
        weight = self.kv_b_proj.weight
        if math_dtype(weight.dtype, weight.device) != weight.dtype:
            self.absorbed = tuple(w.contiguous() for w in self.absorbed_maps(weight.detach().to(torch.float32)))

    def _apply(self, fn, recurse: bool = True):
        self.absorbed = None  # moved or cast: the copies no longer match
        return super()._apply(fn, recurse)

    def kv_pool(self, name: str, *, num_layers: int, block_size: int, dtype: torch.dtype) -> MLAPool:
        """An MLA pool of ``num_layers`` layers of this layer's latent rows (an MLA draft can join a
        target's as extra layers, ``pool.add_layers``)."""
        return MLAPool(name, num_layers=num_layers, block_size=block_size, dtype=dtype,
                       kv_lora_rank=self.settings.kv_lora_rank, qk_rope_head_dim=self.settings.qk_rope_head_dim)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor:
        pool = bound_pool(self.pool)
        s, num_tokens, num_heads = self.settings, x.shape[0], self.num_heads
        nope, rope, rank = s.qk_nope_head_dim, s.qk_rope_head_dim, s.kv_lora_rank
        q = self.q_proj(x) if s.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(num_tokens, num_heads, nope + rope).split([nope, rope], dim=-1)
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split([rank, rope], dim=-1)
        # k_pe is one key shared by all heads: rotate it as a single head.
        q_pe, k_pe = rotary(positions, q_pe, k_pe.unsqueeze(1))
        latent = torch.cat([self.kv_a_layernorm(compressed), k_pe.squeeze(1)], dim=-1)

        kv_b = self.kv_b_proj.weight  # the copies sit outside autograd: a weight being trained skips them
        w_uk, w_uv = self.absorbed if self.absorbed and not kv_b.requires_grad else self.absorbed_maps(kv_b)
        work = w_uk.dtype  # float32 copies round once, as the half product would
        # q_nope . (W_uk c) == (W_uk^T q_nope) . c: score the latent rows directly.
        q_latent = absorbed_query(q_nope.to(work), w_uk).to(x.dtype)
        query = torch.cat([q_latent, q_pe], dim=-1)
        out = ctx.attend_mla(pool, self.layer_idx, query, latent, kv_lora_rank=rank, scale=self.scale)
        # sum_s p_s (W_uv c_s) == W_uv (sum_s p_s c_s): expand the attended latent to per-head values.
        values = expanded_values(out.to(work), w_uv).to(x.dtype)
        return self.o_proj(values.reshape(num_tokens, num_heads * s.v_head_dim))


def absorbed_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``W_uk^T q_nope`` per head: ``q_nope [T, H, nope]``, ``w_uk [H, nope, rank]`` -> ``[T, H, rank]``."""
    return _per_token(lambda t: torch.einsum("thn,hnr->thr", t, w_uk), q_nope)


def expanded_values(latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``W_uv`` applied per head to the attended latent: ``[T, H, rank]``, ``w_uv [H, v, rank]`` -> ``[T, H, v]``."""
    return _per_token(lambda t: torch.einsum("thr,hvr->thv", t, w_uv), latent)


def _per_token(product, x: torch.Tensor) -> torch.Tensor:
    # A per-head batched GEMM over the tokens: in the batch-invariant mode, over fixed blocks of tokens.
    return invariance.in_row_blocks(product, x) if invariance.enabled() else product(x)


class DeepseekV3MLP(GatedMLP):
    """Gated MLP ``down(act(gate(x)) * up(x))``, no biases: the dense layers and the shared experts."""


class DeepseekV3TopkRouter(nn.Module):
    """Sigmoid router with bias-corrected, group-limited top-k selection (DeepSeek-V3 ``noaux_tc``).

    Its parameters stay in at least float32 whatever the model dtype (transformers keeps them in
    float32 too): the correction bias differs between experts by less than bfloat16 resolves, and it
    decides which experts run.
    """

    def __init__(self, s: DeepseekV3Settings):
        super().__init__()
        self.settings = s  # top-k, groups, renormalisation and scaling, read by forward
        self.weight = nn.Parameter(torch.empty(s.num_experts, s.hidden_size, dtype=torch.float32))
        # A parameter, not a buffer, so a checkpoint without it is reported instead of running on garbage.
        self.e_score_correction_bias = nn.Parameter(torch.empty(s.num_experts, dtype=torch.float32))

    def reset_buffers(self) -> None:
        """Undo the loader's cast to a half-precision model dtype (called before the weights are copied in)."""
        for name in ("weight", "e_score_correction_bias"):
            param = getattr(self, name)
            if param.dtype not in (torch.float32, torch.float64):
                param.data = param.data.float()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (mixing weights ``[T, top_k]`` in >= float32, expert ids ``[T, top_k]``)."""
        s, cd = self.settings, compute_dtype(x.dtype)
        scores = invariance.sigmoid(linear(x.to(cd), self.weight.to(cd)))
        choice = scores + self.e_score_correction_bias.to(cd)
        if s.topk_groups < s.num_groups:
            # Keep the topk_groups groups whose two best (biased) experts score highest.
            grouped = choice.view(-1, s.num_groups, s.num_experts // s.num_groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(s.topk_groups, dim=-1, sorted=False).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, s.num_experts)
        ids = choice.topk(s.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, ids


class DeepseekV3Experts(FusedExperts):
    """The routed experts, stacked: ``gate_up_proj [E, 2I, H]`` (gate rows first), ``down_proj [E, H, I]``."""

    def __init__(self, s: DeepseekV3Settings):
        super().__init__(s.num_experts, s.hidden_size, s.moe_intermediate_size, gated_activation(s.hidden_act),
                         top_k=s.top_k)


class DeepseekV3MoE(nn.Module):
    def __init__(self, s: DeepseekV3Settings):
        super().__init__()
        self.gate = DeepseekV3TopkRouter(s)
        self.experts = DeepseekV3Experts(s)
        self.shared_experts = (
            DeepseekV3MLP(s.hidden_size, s.moe_intermediate_size * s.num_shared_experts, s.hidden_act)
            if s.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.to(x.dtype)


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, s: DeepseekV3Settings, layer_idx: int, rms_norm_eps: float):
        super().__init__()
        self.self_attn = DeepseekV3Attention(s, layer_idx)
        if s.is_moe_layer(layer_idx):
            self.mlp = DeepseekV3MoE(s)
        else:
            self.mlp = DeepseekV3MLP(s.hidden_size, s.intermediate_size, s.hidden_act)
        self.input_layernorm = RMSNorm(s.hidden_size, eps=rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, eps=rms_norm_eps)


class DeepseekV3ForCausalLM(DecoderOnlyLM):
    """deepseek_v3 / kimi_k2 causal LM implementing :class:`specdec.models.CausalLM`."""

    def __init__(self, config):
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"DeepseekV3ForCausalLM serves model_type {list(SUPPORTED_MODEL_TYPES)}, got {config.model_type!r}"
            )
        settings = DeepseekV3Settings.from_hf_config(config)
        layers = (DeepseekV3DecoderLayer(settings, i, config.rms_norm_eps) for i in range(settings.num_layers))
        rotary = RotaryEmbedding(config, settings.qk_rope_head_dim, interleaved=settings.rope_interleave)
        super().__init__(config, DecoderModel(config, layers, rotary))
        self.settings = settings
        self.kv_lora_rank = settings.kv_lora_rank
        self.qk_rope_head_dim = settings.qk_rope_head_dim

    # ----- weights -----
    def _checkpoint_name(self, name: str) -> str | SliceTarget | None:
        name = self._common_checkpoint_name(name, bare_model_prefix=False)
        if name is None:
            return None
        layer = _layer_index(name)
        if layer is not None and layer >= self.num_layers:
            # Multi-token-prediction modules sit after the decoder layers; the engine does not run them.
            return None
        # Per-expert tensors fill slices of the stacked experts; those of a dense layer are unexpected.
        sliced = expert_slice(name, self.settings.num_experts, self.settings.moe_intermediate_size)
        return name if sliced is None else sliced


def _layer_index(name: str) -> int | None:
    match = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None
