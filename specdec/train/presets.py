"""Named model + training presets for the zoo targets (tests register tiny ones of their own).

Each preset is a transformers config (built from a plain dict, so the checkpoint is an ordinary
folder that transformers and specdec's loader both read) plus the training schedule. Sizes were
picked from throughput measured on the project's 2-core CPUs (see ``python -m specdec.train
measure``) so that a full run takes at most about an hour and ``--quick`` about a tenth of that.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import attrs

from specdec.train.tokenizer import BOS_ID, EOS_ID, PAD_ID

# model_type -> transformers (config class, causal-LM class) names, imported lazily.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "minimax_m3_vl_text": ("MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM"),
}


def _frozen_mapping(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


@attrs.frozen
class TargetPreset:
    """A target architecture (transformers config fields) and its training schedule."""

    name: str
    model_type: str = attrs.field(validator=attrs.validators.in_(tuple(ARCHITECTURES)))
    config: Mapping[str, Any] = attrs.field(converter=_frozen_mapping)
    seq_len: int = attrs.field(validator=attrs.validators.ge(8))
    batch_size: int = attrs.field(validator=attrs.validators.ge(1))
    steps: int = attrs.field(validator=attrs.validators.ge(1))
    quick_steps: int = attrs.field(validator=attrs.validators.ge(1))
    lr: float = attrs.field(validator=attrs.validators.gt(0.0))
    min_lr_ratio: float = attrs.field(default=0.1, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])
    warmup_steps: int = attrs.field(default=100, validator=attrs.validators.ge(0))
    weight_decay: float = attrs.field(default=0.1, validator=attrs.validators.ge(0.0))
    grad_clip: float = attrs.field(default=1.0, validator=attrs.validators.gt(0.0))
    # Aux-loss-free balancing (DeepSeek-V3): per-step nudge of each router's e_score_correction_bias.
    router_bias_rate: float = attrs.field(default=1e-3, validator=attrs.validators.ge(0.0))
    description: str = ""

    def __attrs_post_init__(self) -> None:
        if "vocab_size" in self.config:
            raise ValueError(f"preset {self.name!r}: vocab_size comes from the tokenizer; drop it from config")
        if self.quick_steps > self.steps:
            raise ValueError(f"preset {self.name!r}: quick_steps ({self.quick_steps}) exceeds steps ({self.steps})")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    def hf_config(self, vocab_size: int):
        """The transformers config for a tokenizer of ``vocab_size`` tokens (zoo special-token ids)."""
        import transformers

        config_cls = getattr(transformers, ARCHITECTURES[self.model_type][0])
        fields = dict(self.config)
        fields.update(vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        return config_cls(**fields)

    def build_model(self, vocab_size: int):
        """A freshly initialised transformers causal LM for this preset (fp32, training mode)."""
        import transformers

        model_cls = getattr(transformers, ARCHITECTURES[self.model_type][1])
        config = self.hf_config(vocab_size)
        # The grouped-mm expert kernel is the fastest on CPU for training (measured; eager loops
        # over experts), and it is not written into config.json, so checkpoints stay neutral.
        config._experts_implementation = "grouped_mm" if self.model_type != "llama" else None
        model = model_cls(config)
        model.train()
        return model


def _rope(theta: float, partial: float | None = None) -> dict:
    rope = {"rope_type": "default", "rope_theta": theta}
    if partial is not None:
        rope["partial_rotary_factor"] = partial
    return rope


def minimax_m3_config(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, rotary_dim: int,
                dense_inter: int, expert_inter: int, experts: int, top_k: int, dense_layers: int,
                topk_blocks: int) -> dict:
    """A MiniMax-M3 text config (block-sparse attention, MoE) of the given sizes."""
    # MiniMax-M3's shape: first layers dense, the rest MoE with a shared expert; layer 0 full
    # attention and the rest block-sparse (128-token blocks, as the real model and its KV pages).
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_parameters=_rope(5e6, rotary_dim / head_dim),
        dense_intermediate_size=dense_inter,
        intermediate_size=expert_inter,
        shared_intermediate_size=expert_inter,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        mlp_layer_types=["dense"] * dense_layers + ["sparse"] * (layers - dense_layers),
        layer_types=["full_attention"] + ["minimax_m3_sparse"] * (layers - 1),
        # One indexer head per KV group, as in the real model (4 indexer heads for 4 KV heads).
        index_n_heads=kv_heads,
        index_head_dim=head_dim,
        index_block_size=128,
        index_topk_blocks=topk_blocks,
        index_local_blocks=1,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


def kimi_k2_config(hidden: int, layers: int, heads: int, q_lora: int | None, kv_lora: int, nope: int, rope: int,
             v_dim: int, dense_inter: int, expert_inter: int, experts: int, top_k: int) -> dict:
    """A Kimi-K2 (DeepSeek-V3: MLA, MoE) config of the given sizes."""
    # Kimi-K2's shape: MLA, first layer dense, sigmoid-routed experts (one group) + 1 shared expert,
    # routed scaling 2.827; no MTP layer (the bundled drafts are EAGLE heads instead).
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_dim,
        intermediate_size=dense_inter,
        moe_intermediate_size=expert_inter,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.827,
        rope_parameters=_rope(50000.0),
        rope_interleave=True,
        num_nextn_predict_layers=0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


def llama_config(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, tied: bool) -> dict:
    """A Llama config (GQA, RoPE) of the given sizes."""
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=inter,
        rope_parameters=_rope(10000.0),
        max_position_embeddings=8192,
        tie_word_embeddings=tied,
    )


PRESETS: dict[str, TargetPreset] = {}


def register_preset(preset: TargetPreset) -> TargetPreset:
    """Make ``preset`` selectable by its name (``python -m specdec.train target --preset NAME``)."""
    PRESETS[preset.name] = preset
    return preset


register_preset(TargetPreset(
    name="minimax-m3-tiny",
    model_type="minimax_m3_vl_text",
    config=minimax_m3_config(hidden=384, layers=6, heads=6, kv_heads=2, head_dim=64, rotary_dim=32,
                       dense_inter=1024, expert_inter=256, experts=4, top_k=2, dense_layers=1, topk_blocks=8),
    seq_len=512, batch_size=8, steps=1600, quick_steps=160, lr=2e-3,
    description="MiniMax-M3-shaped target (14.4M params): block-sparse layers over 128-token pages "
    "(8 blocks attended, so prompts up to 1024 tokens see everything), MoE 4 experts top-2 + shared",
))
register_preset(TargetPreset(
    name="kimi-k2-tiny",
    model_type="deepseek_v3",
    config=kimi_k2_config(hidden=256, layers=4, heads=4, q_lora=96, kv_lora=64, nope=32, rope=16, v_dim=32,
                    dense_inter=512, expert_inter=96, experts=8, top_k=2),
    seq_len=512, batch_size=8, steps=600, quick_steps=60, lr=2e-3,
    description="Kimi-K2-shaped deepseek_v3 target: MLA (q_lora 96, kv_lora 64, rope 16), first layer "
    "dense, 8 sigmoid-routed experts top-2 + 1 shared",
))
register_preset(TargetPreset(
    name="llama-tiny",
    model_type="llama",
    config=llama_config(hidden=256, layers=4, heads=4, kv_heads=2, inter=512, tied=True),
    seq_len=512, batch_size=8, steps=1200, quick_steps=120, lr=2e-3,
    description="Llama-shaped target with GQA and tied embeddings",
))
register_preset(TargetPreset(
    name="draft-model-tiny",
    model_type="llama",
    config=llama_config(hidden=128, layers=2, heads=2, kv_heads=1, inter=384, tied=True),
    seq_len=512, batch_size=8, steps=1200, quick_steps=120, lr=3e-3,
    description="Independent small LM for the draft_model proposer (same tokenizer as the targets)",
))

def get_preset(name: str) -> TargetPreset:
    """The preset called ``name``, with the list of choices when there is none."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
