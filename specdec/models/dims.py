"""Attention dimensions read from a transformers config, with the defaults transformers applies."""

from __future__ import annotations


def head_dim_of(config) -> int:
    """``config.head_dim``, else ``hidden_size / num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_gqa(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )


def gqa_dims(config) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)``; no ``num_key_value_heads`` means plain multi-head."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    check_gqa(num_heads, num_kv_heads)
    return num_heads, num_kv_heads, head_dim_of(config)


def rotary_dim_of(config) -> int:
    """Rotated channels per head, as transformers derives them: ``head_dim * partial_rotary_factor``."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    dim = int(head_dim_of(config) * factor)
    if not 0 < dim <= head_dim_of(config) or dim % 2:
        raise ValueError(
            f"partial_rotary_factor {factor} gives {dim} rotary channels for head_dim {head_dim_of(config)}; "
            "it must give an even number between 2 and head_dim"
        )
    return dim
