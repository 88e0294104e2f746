"""``model_type`` -> model class, in one :class:`~specdec.registry.Registry`: the built-ins (imported
lazily), :func:`register_architecture` in the process, and entry points of installed distributions in
group ``specdec.architectures`` (``model_type = "pkg.module:ModelClass"``)."""

from __future__ import annotations

from specdec.registry import Registry

ARCHITECTURES: Registry[type] = Registry(
    "model_type",
    "specdec.architectures",
    {
        "llama": "specdec.models.llama:LlamaForCausalLM",
        "mistral": "specdec.models.llama:LlamaForCausalLM",
        "qwen2": "specdec.models.llama:LlamaForCausalLM",
        "qwen3": "specdec.models.llama:LlamaForCausalLM",
        "deepseek_v3": "specdec.models.deepseek_v3:DeepseekV3ForCausalLM",
        "kimi_k2": "specdec.models.deepseek_v3:DeepseekV3ForCausalLM",
        "minimax_m2": "specdec.models.minimax_m2:MiniMaxM2ForCausalLM",
        "minimax_m3_vl_text": "specdec.models.minimax_m3:MiniMaxM3ForCausalLM",
        "minimax_m3_vl": "specdec.models.minimax_m3:MiniMaxM3ForCausalLM",
    },
    missing="unsupported {kind} {name}; supported: {choices}",
)


def register_architecture(model_type: str, target: str | type) -> None:
    """Serve checkpoints of ``model_type`` with ``target`` (a class or ``"module:Class"``)."""
    ARCHITECTURES.register(model_type, target)


def supported_model_types() -> list[str]:
    return ARCHITECTURES.names()


def model_class(hf_config):
    return ARCHITECTURES.get(getattr(hf_config, "model_type", None))
