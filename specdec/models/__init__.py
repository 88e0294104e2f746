"""Target (and draft) architectures over the paged KV cache, loaded from HF checkpoints."""

from specdec.models.base import (
    AttentionContext,
    CausalLM,
    ForwardContext,
    ModelOutput,
    PagedModel,
    default_aux_layer_ids,
)
from specdec.models.loader import CheckpointError, load_config, load_model
from specdec.models.registry import register_architecture, supported_model_types

# Architecture modules register themselves here by model_type (imported lazily).

__all__ = [
    "AttentionContext",
    "CausalLM",
    "CheckpointError",
    "ForwardContext",
    "ModelOutput",
    "PagedModel",
    "default_aux_layer_ids",
    "load_config",
    "load_model",
    "register_architecture",
    "supported_model_types",
]
