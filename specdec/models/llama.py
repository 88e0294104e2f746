"""Llama-family decoders (llama, mistral, qwen2, qwen3) over the paged KV cache.

One class serves the four ``model_type``s; they differ only in switches read from the config:
qwen2's q/k/v bias, qwen3's per-head q/k RMSNorm, llama's ``attention_bias`` / ``mlp_bias``, and
sliding-window attention (mistral: every layer when ``sliding_window`` is set; qwen2/qwen3: the
layers ``layer_types`` marks ``sliding_attention``). The module tree mirrors the checkpoint names
transformers writes (``model.layers.N.self_attn.q_proj.weight``, ...), so weights load by name.
"""

from __future__ import annotations

from specdec.models.attention import GQASelfAttention
from specdec.models.decoder import DecoderModel, DecoderOnlyLM, PreNormDecoderLayer
from specdec.models.dims import head_dim_of
from specdec.models.layers import GatedMLP, RMSNorm, RotaryEmbedding

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def sliding_windows(config) -> list[int | None]:
    """The attention window of each layer (None = full causal attention), as transformers applies it."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * num_layers
    if config.model_type == "mistral":
        # MistralModel applies the window to every layer and ignores any layer_types.
        return [window] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(
            f"config.layer_types has {len(layer_types)} entries for {num_layers} layers; give one per layer"
        )
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(
            f"unsupported layer_types {unknown} for {config.model_type}; "
            "expected 'full_attention' or 'sliding_attention'"
        )
    return [window if t == "sliding_attention" else None for t in layer_types]


class LlamaAttention(GQASelfAttention):
    """GQA self-attention whose K/V live in layer ``layer_idx`` of a paged attention pool."""

    def __init__(self, config, layer_idx: int, sliding_window: int | None):
        if config.model_type == "qwen2":
            # Qwen2 always has q/k/v biases and never an o_proj bias (its config has no switch).
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, qkv_bias=qkv_bias, o_bias=o_bias)
        self.sliding_window = sliding_window
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)


class LlamaMLP(GatedMLP):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU for the usual ``hidden_act="silu"``)."""

    def __init__(self, config):
        super().__init__(
            config.hidden_size,
            config.intermediate_size,
            getattr(config, "hidden_act", "silu"),
            bias=bool(getattr(config, "mlp_bias", False)),
        )


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int, sliding_window: int | None):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, sliding_window)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaForCausalLM(DecoderOnlyLM):
    """llama / mistral / qwen2 / qwen3 causal LM implementing :class:`specdec.models.CausalLM`."""

    def __init__(self, config):
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"LlamaForCausalLM serves model_type {list(SUPPORTED_MODEL_TYPES)}, got {config.model_type!r}"
            )
        layers = (LlamaDecoderLayer(config, i, window) for i, window in enumerate(sliding_windows(config)))
        super().__init__(config, DecoderModel(config, layers, RotaryEmbedding(config, head_dim_of(config))))
