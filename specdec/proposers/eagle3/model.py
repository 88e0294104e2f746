"""The Llama-style EAGLE3 / EAGLE3.1 draft: one GQA decoder layer whose q/k/v read a 2H input."""

from __future__ import annotations

import torch
from torch import nn

from specdec.cache.pool import AttentionPool, PagedPool
from specdec.models.base import ForwardContext
from specdec.models.layers import Linear, PackedLinear, RotaryEmbedding
from specdec.models.llama import LlamaMLP
from specdec.proposers.eagle3.config import Eagle3DraftConfig
from specdec.proposers.eagle3.head import Eagle3DecoderLayer, Eagle3Head


class Eagle3Attention(nn.Module):
    """GQA attention over ``cat([embed, hidden])`` (2H wide) back to H; KV in an attention pool."""

    def __init__(self, config: Eagle3DraftConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        width, bias = 2 * config.hidden_size, config.attention_bias
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # One GEMM for q/k/v, filled from (and saved as) the checkpoint's q_proj / k_proj / v_proj.
        self.qkv_proj = PackedLinear(width, {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width}, bias=bias)
        self.o_proj = Linear(q_width, config.hidden_size, bias=bias)
        self.pool: str | None = None
        self.layer_idx = 0

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        if self.pool is None:
            raise RuntimeError("the draft's attention is not bound to a KV pool: call kv_pools() first")
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = ctx.attend(self.pool, self.layer_idx, q, k, v, scale=self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class Eagle3LlamaDraft(Eagle3Head):
    """EAGLE3 head with MHA/GQA attention (EAGLE reference, SGLang/SpecForge and vLLM layouts).

    Its KV lives in a pool of its own (:meth:`kv_pools`), with any page size: the draft never shares
    pages with the target, so it is indexed by its own block tables.
    """

    is_mla = False

    def _build_layer(self, config: Eagle3DraftConfig) -> Eagle3DecoderLayer:
        return Eagle3DecoderLayer(config, Eagle3Attention(config), LlamaMLP(config.hf_config))

    def _build_rotary(self, config: Eagle3DraftConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.hf_config, config.head_dim)

    def kv_pools(self, prefix: str, block_size: int, dtype: torch.dtype) -> list[PagedPool]:
        """One single-layer attention pool named ``prefix``; binds the draft's attention to it."""
        attn = self.midlayer.self_attn
        pool = AttentionPool(
            prefix,
            num_layers=1,
            block_size=block_size,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            dtype=dtype,
        )
        attn.pool, attn.layer_idx = prefix, 0
        return [pool]
