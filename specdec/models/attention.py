"""What the GQA self-attention layers (llama family, MiniMax-M2, MiniMax-M3, the EAGLE3 draft) share."""

from __future__ import annotations

import torch
from torch import nn

from specdec.cache.pool import AttentionPool
from specdec.models.base import AttentionContext
from specdec.models.decoder import bound_pool
from specdec.models.dims import gqa_dims
from specdec.distributed import parallel_state as ps
from specdec.models.layers import PackedLinear, RotaryEmbedding
from specdec.models.parallel import HeadShard, RowParallelLinear


class GQASelfAttention(nn.Module):
    """Head counts read (and checked) from the config, the projections, the ``1/sqrt(head_dim)``
    scale, the pool slot ``kv_pools`` binds, and the forward: roped heads, attention in layer
    ``layer_idx`` of the bound pool, ``o_proj``. Under tensor parallelism ``num_heads`` /
    ``num_kv_heads`` are this rank's (q/k/v column-parallel by head, ``o_proj`` row-parallel).

    q, k and v run as one :class:`~specdec.models.layers.PackedLinear` (``qkv_proj``, loaded from the
    checkpoint's ``q_proj`` / ``k_proj`` / ``v_proj``) reading ``input_size`` features (default the
    hidden size). Subclasses add per-head ``q_norm`` / ``k_norm`` (applied by :meth:`qkv_heads`), or
    override :meth:`qkv_heads` for other norms, and :meth:`key_mask` for block-sparse attention.
    """

    # Keys further back than this many positions are not attended (None: full causal attention).
    sliding_window: int | None = None

    def __init__(
        self, config, layer_idx: int, *, input_size: int | None = None, qkv_bias: bool = False, o_bias: bool = False
    ):
        super().__init__()
        self.layer_idx = layer_idx
        num_heads, num_kv_heads, self.head_dim = gqa_dims(config)
        # This rank's heads (all of them with one rank); KV heads fewer than the ranks are replicated.
        q_heads = HeadShard.split(num_heads, "num_attention_heads")
        kv_heads = HeadShard.of(num_kv_heads, "num_key_value_heads")
        self.num_heads, self.num_kv_heads = q_heads.local, kv_heads.local
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(
            hidden if input_size is None else input_size,
            {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width},
            bias=qkv_bias,
            shards={"q_proj": q_heads.spec, "k_proj": kv_heads.spec, "v_proj": kv_heads.spec},
        )
        self.o_proj = RowParallelLinear(q_width * ps.current().size, hidden, bias=o_bias)
        self.q_norm: nn.Module | None = None  # per-head norms, set by subclasses that have them
        self.k_norm: nn.Module | None = None
        self.pool: str | None = None  # bound by the model's kv_pools()

    def kv_pool(self, name: str, *, num_layers: int, block_size: int, dtype: torch.dtype) -> AttentionPool:
        """An attention pool of ``num_layers`` layers shaped like this layer's K/V."""
        return AttentionPool(name, num_layers=num_layers, block_size=block_size, dtype=dtype,
                             num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [T, H * D]``, ``k`` and ``v [T, Hkv * D]`` of ``x [T, input_size]`` (views of one output)."""
        return self.qkv_proj.split(self.qkv_proj(x))

    def qkv_heads(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [T, H, D]``, ``k`` and ``v [T, Hkv, D]``: split into heads, q/k normed per head (when the
        layer has norms) and roped."""
        n, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is None:
            # q and k sit side by side in the packed output: one rotation covers both (half the ops).
            qkv = self.qkv_proj(x)
            qk_width = (heads + kv_heads) * dim
            (qk,) = rotary(positions, qkv[:, :qk_width].view(n, heads + kv_heads, dim))
            return qk[:, :heads], qk[:, heads:], qkv[:, qk_width:].view(n, kv_heads, dim)
        q, k, v = self.project_qkv(x)
        q, k = self.q_norm(q.view(n, heads, dim)), self.k_norm(k.view(n, kv_heads, dim))
        q, k = rotary(positions, q, k)
        return q, k, v.view(n, kv_heads, dim)

    def key_mask(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor | None:
        """The keys each query head group may see (block-sparse attention), or None for all of them."""
        return None

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor:
        pool = bound_pool(self.pool)
        q, k, v = self.qkv_heads(x, positions, rotary)
        key_mask = self.key_mask(x, positions, rotary, ctx)
        out = ctx.attend(
            pool, self.layer_idx, q, k, v, scale=self.scale, sliding_window=self.sliding_window, key_mask=key_mask
        )
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))
