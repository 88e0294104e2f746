"""The MLA EAGLE3 / EAGLE3.1 draft (``Eagle3DeepseekV2ForCausalLM`` layout) for DeepSeek-V3 / Kimi-K2.

The decoder layer is DeepSeek MLA attention whose input projections (``q_a_proj`` or ``q_proj``,
``kv_a_proj_with_mqa``) read the 2H ``cat([embed, hidden])``, a dense SwiGLU MLP, and the usual
EAGLE3 norms. The attention itself is :class:`specdec.models.deepseek_v3.DeepseekV3Attention`
(absorbed MLA over an MLA pool, interleaved RoPE), so its latent rows have the target's MLA shape and
the draft can live in the target's MLA pool as one extra layer (:meth:`Eagle3MLADraft.join_pool`).
"""

from __future__ import annotations

import attrs

from specdec.cache.pool import KVPool, MLAPool
from specdec.models.deepseek_v3 import DeepseekV3Attention, DeepseekV3MLP, DeepseekV3Settings
from specdec.models.layers import RotaryEmbedding
from specdec.models.parallel import RowParallelLinear
from specdec.proposers.eagle3.config import Eagle3DraftConfig
from specdec.proposers.eagle3.head import Eagle3DecoderLayer, Eagle3Head


def _mla_attention(config: Eagle3DraftConfig) -> DeepseekV3Attention:
    """The target's MLA attention, built for a 2H input and an H output."""
    settings = DeepseekV3Settings.from_hf_config(config.hf_config)
    # The target's attention reads and writes hidden_size; the draft reads 2H, so build it for 2H
    # and give it an o_proj back to H. The MoE settings play no part in a dense draft layer.
    settings = attrs.evolve(settings, hidden_size=2 * config.hidden_size, num_experts=0)
    attn = DeepseekV3Attention(settings, layer_idx=0)
    attn.o_proj = RowParallelLinear(
        config.num_attention_heads * config.v_head_dim, config.hidden_size, bias=config.attention_bias
    )
    # transformers pins the latent norms' epsilon at 1e-6 for targets, but MLA drafts only exist in
    # serving engines, which use the config's rms_norm_eps: that is what the draft was trained against.
    for name in ("q_a_layernorm", "kv_a_layernorm"):
        norm = getattr(attn, name, None)
        if norm is not None:
            norm.eps = config.rms_norm_eps
    return attn


class Eagle3MLADraft(Eagle3Head):
    """EAGLE3 head with DeepSeek MLA attention.

    Pools: :meth:`kv_pools` gives it an MLA pool of its own (under a non-MLA target); under an MLA
    target call :meth:`join_pool` on the target's (unmaterialised) MLA pool instead, which reserves
    :meth:`mla_pool_layers` extra layers there and binds the draft to them.
    """

    is_mla = True

    def _build_layer(self, config: Eagle3DraftConfig) -> Eagle3DecoderLayer:
        mlp = DeepseekV3MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return Eagle3DecoderLayer(config, _mla_attention(config), mlp)

    def _build_rotary(self, config: Eagle3DraftConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.hf_config, config.qk_rope_head_dim, interleaved=config.rope_interleave)

    @property
    def kv_lora_rank(self) -> int:
        return self.config.kv_lora_rank

    @property
    def qk_rope_head_dim(self) -> int:
        return self.config.qk_rope_head_dim

    # ----- pools -----
    def mla_pool_layers(self) -> int:
        """Layers the draft needs in a shared MLA pool."""
        return 1

    def check_pool(self, pool: KVPool) -> None:
        """Raise ValueError unless ``pool`` is an MLA pool whose latent rows have the draft's shape."""
        if not isinstance(pool, MLAPool):
            raise ValueError(
                f"pool {pool.name!r} is a {pool.kind!r} pool; the MLA draft's latent KV needs an MLA pool"
            )
        if (pool.kv_lora_rank, pool.qk_rope_head_dim) != (self.kv_lora_rank, self.qk_rope_head_dim):
            raise ValueError(
                f"MLA pool {pool.name!r} holds latents of kv_lora_rank {pool.kv_lora_rank} + rope "
                f"{pool.qk_rope_head_dim}; the draft's are {self.kv_lora_rank} + {self.qk_rope_head_dim}, so it "
                "cannot live in that pool: give the draft its own pool (kv_pools)"
            )

    def bind_pool(self, pool: KVPool, layer_index: int) -> None:
        """Keep the draft's latent rows in layer ``layer_index`` of ``pool`` (checked with :meth:`check_pool`)."""
        self.check_pool(pool)
        if not 0 <= layer_index < pool.num_layers:
            raise ValueError(
                f"pool {pool.name!r} has {pool.num_layers} layers, cannot bind the draft to layer {layer_index}"
            )
        super().bind_pool(pool, layer_index)

    def join_pool(self, pool: KVPool) -> int:
        """Add the draft's layer to a target MLA pool before it is materialised; returns its index."""
        self.check_pool(pool)
        (index,) = pool.add_layers(self.mla_pool_layers())
        self.bind_pool(pool, index)
        return index
