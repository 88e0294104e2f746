"""The Llama-style EAGLE3 / EAGLE3.1 draft: one GQA decoder layer whose q/k/v read a 2H input."""

from __future__ import annotations

from specdec.models.attention import GQASelfAttention
from specdec.models.layers import RotaryEmbedding
from specdec.models.llama import LlamaMLP
from specdec.proposers.eagle3.config import Eagle3DraftConfig
from specdec.proposers.eagle3.head import Eagle3DecoderLayer, Eagle3Head


class Eagle3Attention(GQASelfAttention):
    """GQA attention over ``cat([embed, hidden])`` (2H wide) back to H; KV in an attention pool."""

    def __init__(self, config: Eagle3DraftConfig):
        bias = config.attention_bias
        super().__init__(config, 0, input_size=2 * config.hidden_size, qkv_bias=bias, o_bias=bias)


class Eagle3LlamaDraft(Eagle3Head):
    """EAGLE3 head with MHA/GQA attention (EAGLE reference, SGLang/SpecForge and vLLM layouts).

    Its KV lives in an attention pool of its own (:meth:`kv_pools`), with any page size: the draft
    never shares pages with the target, so it is indexed by its own block tables.
    """

    is_mla = False

    def _build_layer(self, config: Eagle3DraftConfig) -> Eagle3DecoderLayer:
        return Eagle3DecoderLayer(config, Eagle3Attention(config), LlamaMLP(config.hf_config))

    def _build_rotary(self, config: Eagle3DraftConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.hf_config, config.head_dim)
