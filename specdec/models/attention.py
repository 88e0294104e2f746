"""What the GQA self-attention layers (llama family, MiniMax-M2, MiniMax-M3) build the same way."""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.dims import gqa_dims
from specdec.models.layers import Linear, PackedLinear


class GQASelfAttention(nn.Module):
    """Head counts read (and checked) from the config, the projections, the ``1/sqrt(head_dim)``
    scale, and the pool slot ``kv_pools`` binds.

    q, k and v run as one :class:`~specdec.models.layers.PackedLinear` (``qkv_proj``, loaded from the
    checkpoint's ``q_proj`` / ``k_proj`` / ``v_proj``); :meth:`project_qkv` returns them split.
    Subclasses add their q/k norms and write ``forward``; K/V live in layer ``layer_idx`` of the pool.
    """

    def __init__(self, config, layer_idx: int, *, qkv_bias: bool = False, o_bias: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = gqa_dims(config)
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(hidden, {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width}, bias=qkv_bias)
        self.o_proj = Linear(q_width, hidden, bias=o_bias)
        self.pool: str | None = None  # bound by the model's kv_pools()

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [T, H * D]``, ``k`` and ``v [T, Hkv * D]`` of ``x [T, hidden]`` (views of one output)."""
        return self.qkv_proj.split(self.qkv_proj(x))
