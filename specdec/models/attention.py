"""What the GQA self-attention layers (llama family, MiniMax-M2, MiniMax-M3) build the same way."""

from __future__ import annotations

from torch import nn

from specdec.models.dims import gqa_dims


class GQASelfAttention(nn.Module):
    """Head counts read (and checked) from the config, the ``q/k/v/o_proj`` projections under their
    checkpoint names, the ``1/sqrt(head_dim)`` scale, and the pool slot ``kv_pools`` binds.

    Subclasses add their q/k norms and write ``forward``; K/V live in layer ``layer_idx`` of the pool.
    """

    def __init__(self, config, layer_idx: int, *, qkv_bias: bool = False, o_bias: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = gqa_dims(config)
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.pool: str | None = None  # bound by the model's kv_pools()
