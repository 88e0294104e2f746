"""MiniMax-M2 (``minimax_m2``) over the paged KV cache.

GQA attention with one RMSNorm over the *whole* q and k projections (not per head), partial RoPE
(``rope_parameters["partial_rotary_factor"]``; old hub configs say ``rotary_dim``), and a
sigmoid-routed MoE with a score-correction bias and no shared expert in every layer.

The MoE pieces (router, stacked experts, per-expert checkpoint loading) live in
:mod:`specdec.models.moe`, shared with MiniMax-M3 and DeepSeek-V3; checkpoints written per expert
(``block_sparse_moe.experts.N.w1/w2/w3``, what ``save_pretrained`` and the hub write) stream into
slices of the stacked tensors.
"""

from __future__ import annotations

import re

import torch
from torch import nn

# aux_capture_counts, check_gqa, head_dim_of and load_weights_with_slices are re-exported: they were
# first defined here.
from specdec.models.attention import GQASelfAttention
from specdec.models.decoder import DecoderModel, DecoderOnlyLM, PreNormDecoderLayer, aux_capture_counts  # noqa: F401
from specdec.distributed import parallel_state as ps
from specdec.models.dims import check_gqa, gqa_dims, head_dim_of, rotary_dim_of  # noqa: F401
from specdec.models.layers import Linear, RMSNorm, RotaryEmbedding, compute_dtype
from specdec.models.parallel import split_spec
from specdec.models.moe import FusedExperts, expert_slice, gated_activation, sigmoid_topk_routing
from specdec.models.weights import SliceTarget, load_weights_with_slices  # noqa: F401


def is_mtp_tensor(name: str) -> bool:
    """MiniMax's multi-token-prediction modules (``mtp.*``): the target does not run them."""
    return re.search(r"(^|\.)mtp\.", name) is not None


class WidthSplitRMSNorm(RMSNorm):
    """RMSNorm over ``hidden_size`` features per rank that are one rank's share of a wider vector: the
    mean square is summed over the ranks (one all-reduce of a column), the weight is this rank's."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__(hidden_size, eps=eps)
        self.tp = ps.current()
        self.tp_shards = {"weight": split_spec(0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        work = compute_dtype(x.dtype)
        xw = x.to(work)
        mean_square = ps.all_reduce(self.tp, xw.pow(2).sum(dim=-1, keepdim=True)) / (x.shape[-1] * self.tp.size)
        return (xw * torch.rsqrt(mean_square + self.eps) * self.weight.to(work)).to(x.dtype)


class MiniMaxM2Attention(GQASelfAttention):
    """GQA attention; q_norm / k_norm normalise the full projection width before the head split."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        size = ps.current().size
        if size > 1 and self.num_kv_heads * size != gqa_dims(config)[1]:
            raise ValueError(
                f"MiniMax-M2 normalises k across all KV heads, so tensor_parallel_size {size} must divide "
                f"num_key_value_heads ({gqa_dims(config)[1]}); choose one that does"
            )
        self.q_norm = WidthSplitRMSNorm(self.num_heads * self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = WidthSplitRMSNorm(self.num_kv_heads * self.head_dim, eps=config.rms_norm_eps)

    def qkv_heads(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        q, k, v = self.project_qkv(x)
        q = self.q_norm(q).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(n, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        return q, k, v.view(n, self.num_kv_heads, self.head_dim)


class MiniMaxM2SparseMoeBlock(nn.Module):
    """Sigmoid router with score-correction bias over fused experts; no shared expert."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        num_experts = config.num_local_experts
        activation = gated_activation(getattr(config, "hidden_act", "silu"))
        self.gate = Linear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, config.hidden_size, config.intermediate_size, activation,
                                    top_k=self.top_k)
        # A parameter (not a buffer) so that a checkpoint without it is reported as incomplete.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = sigmoid_topk_routing(self.gate(x), self.e_score_correction_bias, self.top_k)
        return self.experts(x, experts, weights).to(x.dtype)


class MiniMaxM2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = MiniMaxM2Attention(config, layer_idx)
        self.mlp = MiniMaxM2SparseMoeBlock(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MiniMaxM2ForCausalLM(DecoderOnlyLM):
    """``minimax_m2`` causal LM implementing :class:`specdec.models.CausalLM`."""

    def __init__(self, config):
        if config.model_type != "minimax_m2":
            raise ValueError(f"MiniMaxM2ForCausalLM serves model_type 'minimax_m2', got {config.model_type!r}")
        layers = (MiniMaxM2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        super().__init__(config, DecoderModel(config, layers, RotaryEmbedding(config, rotary_dim_of(config))))
        self._num_experts = config.num_local_experts
        self._intermediate = config.intermediate_size

    # ----- weights -----
    def _checkpoint_name(self, name: str) -> str | SliceTarget | None:
        if is_mtp_tensor(name):
            return None
        name = self._common_checkpoint_name(name)
        if name is None:
            return None
        sliced = expert_slice(name, self._num_experts, self._intermediate)
        if sliced is not None:
            return sliced
        # Hub / save_pretrained spellings -> the module tree (transformers' own internal names).
        name = name.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.e_score_correction_bias")
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
        return name.replace(".block_sparse_moe.", ".mlp.")
