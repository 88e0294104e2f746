"""A draft for a target: its ``config.json``, the serving module freshly initialised, and its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from specdec.models.weights import checkpoint_parameters
from specdec.proposers.eagle3.config import Eagle3DraftConfig
from specdec.proposers.eagle3.config import (
    resolve_aux_layer_ids as serving_aux_layer_ids,
)
from specdec.proposers.eagle3.head import Eagle3Head
from specdec.proposers.eagle3.kv_sharing import choose_shared_layer
from specdec.train.draft.hf_target import HFTarget
from specdec.train.draft.presets import DraftPreset
from specdec.train.run import write_training_record
from specdec.train.tokenizer import BOS_ID, EOS_ID, PAD_ID
from specdec.train.vocab import DraftVocab


def resolve_aux_layer_ids(preset: DraftPreset, target: HFTarget) -> tuple[int, ...]:
    """The target layers the draft reads: the preset's ids (distinct, ascending) or EAGLE3's default,
    by the rule serving applies to the saved config, so the served draft reads what it was trained on."""
    ids = preset.aux_layer_ids
    if ids is not None and (list(ids) != sorted(set(ids)) or min(ids) < 0):
        raise ValueError(f"draft preset {preset.name!r}: aux_layer_ids {list(ids)} must be distinct, ascending "
                         "and >= 0 (capture-before: id i is the input of target layer i)")
    return serving_aux_layer_ids(ids, target.num_layers)


def resolve_kv_sharing_layer(preset: DraftPreset, target: HFTarget, kv_heads: int, head_dim: int) -> int | None:
    """The target layer whose K/V a KV-sharing draft reads at prompt positions, by serving's rule."""
    if not preset.kv_sharing:
        return None
    return choose_shared_layer(target.layer_kv_layouts(), ("attention", kv_heads, head_dim, head_dim),
                               requested=preset.kv_sharing_layer)


def draft_config_dict(preset: DraftPreset, target: HFTarget, vocab: DraftVocab, aux_ids: tuple[int, ...],
                      kv_layer: int | None) -> dict:
    """The complete ``config.json`` of the draft (EAGLE3 keys in ``eagle_config``)."""
    tc = target.config
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    rope.pop("partial_rotary_factor", None)  # the draft rotates whole heads
    eagle = {
        "eagle_aux_hidden_state_layer_ids": list(aux_ids),
        "use_aux_hidden_state": True,
        "fc_norm": preset.eagle31,
        "norm_output": preset.eagle31,
    }
    if preset.unshifted:
        # Read by the unshifted proposer: draft token p sits at position p with the target's hidden
        # state of p - 1; position 0 gets a zero bootstrap hidden state (as in training).
        eagle["unshifted"] = True
        eagle["bootstrap_hidden"] = "zeros"
        if kv_layer is not None:
            eagle["kv_sharing_target_layers"] = {"0": kv_layer}
    config = {
        "hidden_size": target.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": 1,
        "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
        "hidden_act": "silu",
        "vocab_size": target.vocab_size,
        "draft_vocab_size": vocab.size,
        "target_hidden_size": target.hidden_size,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 8192)),
        "rope_parameters": rope,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": "bfloat16",
        "eagle_config": eagle,
    }
    if preset.attention == "mha":
        heads = preset.num_attention_heads or tc.num_attention_heads
        config.update(
            architectures=["LlamaForCausalLMEagle3"],
            model_type="llama",
            num_attention_heads=heads,
            num_key_value_heads=preset.num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=preset.head_dim or getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            mlp_bias=False,
        )
    else:
        if not getattr(tc, "kv_lora_rank", None):
            raise ValueError(f"an MLA draft needs an MLA target; {target.folder} ({tc.model_type}) has no kv_lora_rank")
        config.update(
            architectures=["Eagle3DeepseekV2ForCausalLM"],
            model_type="deepseek_v3",
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=tc.num_attention_heads,
            q_lora_rank=tc.q_lora_rank,
            kv_lora_rank=tc.kv_lora_rank,
            qk_nope_head_dim=tc.qk_nope_head_dim,
            qk_rope_head_dim=tc.qk_rope_head_dim,
            v_head_dim=tc.v_head_dim,
            rope_interleave=bool(getattr(tc, "rope_interleave", True)),
        )
    return config


def build_draft(config: dict, aux_ids: tuple[int, ...], target: HFTarget, vocab: DraftVocab,
                own_lm_head: bool, seed: int) -> Eagle3Head:
    """The serving draft module for ``config``, freshly initialised (fp32) and wired to the target."""
    parsed = Eagle3DraftConfig.from_dict(config)
    if parsed.attention == "mla":
        from specdec.proposers.eagle3.mla_model import Eagle3MLADraft as cls
    else:
        from specdec.proposers.eagle3.model import Eagle3LlamaDraft as cls
    torch.manual_seed(seed)
    draft = cls(parsed, aux_layer_ids=aux_ids, target_hidden_size=target.hidden_size, own_embedding=False,
                own_lm_head=own_lm_head)
    # Checkpoint order and shapes (packed projections as their parts), so a seed draws what it always drew.
    for name, param in checkpoint_parameters(draft):
        with torch.no_grad():
            if param.ndim >= 2:
                param.normal_(0.0, 0.02)
            else:
                param.fill_(1.0)  # RMSNorm gains
    with torch.no_grad():
        draft.d2t.copy_(vocab.d2t)
        draft.t2d.copy_(vocab.t2d)
        if own_lm_head:
            # Start from the target's own rows: the fused hidden begins near the target's space.
            draft.lm_head.weight.copy_(target.output_weight()[vocab.target_ids])
    # The target's embedding and (without an own lm_head) output rows, frozen and not saved.
    draft.share_target(SimpleNamespace(embed=target.embed), None if own_lm_head else target.output_weight())
    # Bind the attention to a (never materialised) pool name: TTTContext ignores pools.
    draft.kv_pools("draft", 16, torch.float32)
    draft.train()
    return draft


def save_draft(draft: Eagle3Head, config: dict, vocab: DraftVocab, folder: str | Path, metadata: dict | None = None,
               dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the draft in the ``layers.0.*`` layout (bf16) with ``d2t``/``t2d`` when the vocabulary is reduced."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, param in checkpoint_parameters(draft):
        key = "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name
        tensors[key] = param.detach().to(dtype).contiguous()
    if not vocab.is_full:
        tensors["d2t"] = vocab.d2t.contiguous()
        tensors["t2d"] = vocab.t2d.contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # Written through the serving config class, so what is saved is what serving reads back.
    config = Eagle3DraftConfig.from_dict(dict(config, dtype=str(dtype).removeprefix("torch."))).to_dict()
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if metadata is not None:
        write_training_record(folder, metadata)
    return folder
