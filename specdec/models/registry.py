"""``model_type`` -> model class, filled by the architecture modules as they are imported."""

from __future__ import annotations

import importlib

# model_type -> "module:Class"; modules are imported lazily.
_ARCHITECTURES: dict[str, str] = {
    "llama": "specdec.models.llama:LlamaForCausalLM",
    "mistral": "specdec.models.llama:LlamaForCausalLM",
    "qwen2": "specdec.models.llama:LlamaForCausalLM",
    "qwen3": "specdec.models.llama:LlamaForCausalLM",
    "deepseek_v3": "specdec.models.deepseek_v3:DeepseekV3ForCausalLM",
    "kimi_k2": "specdec.models.deepseek_v3:DeepseekV3ForCausalLM",
    "minimax_m2": "specdec.models.minimax_m2:MiniMaxM2ForCausalLM",
    "minimax_m3_vl_text": "specdec.models.minimax_m3:MiniMaxM3ForCausalLM",
    "minimax_m3_vl": "specdec.models.minimax_m3:MiniMaxM3ForCausalLM",
}


def register_architecture(model_type: str, target: str) -> None:
    _ARCHITECTURES[model_type] = target


def supported_model_types() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class(hf_config):
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    module_name, attr = _ARCHITECTURES[model_type].split(":")
    return getattr(importlib.import_module(module_name), attr)
