"""The causal-LM shell every architecture shares.

:class:`DecoderOnlyLM` holds what does not depend on the attention or MLP kind: the embeddings, the
decoder-layer loop with capture-before aux hidden states, the final norm, the (optionally tied) LM
head, binding attention layers to their KV pool, and the checkpoint-name rules all checkpoints follow.
An architecture builds its ``model`` (a :class:`DecoderModel`: ``embed_tokens``, ``layers``,
``norm``, ``rotary_emb``, the names transformers writes) from its own decoder layers and overrides
only what differs: ``kv_pools`` for extra pools, ``_checkpoint_name`` for other tensor spellings.
"""

from __future__ import annotations

import operator
from typing import Iterable, Sequence

import torch
from torch import nn

from specdec.cache.pool import KVPool
from specdec.models.base import AttentionContext, ModelOutput
from specdec.models.layers import PrepackedLMHead, RMSNorm, RotaryEmbedding
from specdec.models.parallel import VocabParallelEmbedding, VocabParallelHead
from specdec.models.weights import load_named_weights


def aux_capture_counts(aux_layer_ids: Sequence[int], num_layers: int) -> dict[int, int]:
    """How often each layer's input is captured (repeats allowed: small models' default ids collide)."""
    counts: dict[int, int] = {}
    for raw in aux_layer_ids:
        i = operator.index(raw) if not isinstance(raw, bool) else -1
        if not 0 <= i < num_layers:
            raise ValueError(
                f"aux layer id {raw!r} is out of range: ids name the input of a decoder layer, "
                f"0..{num_layers - 1} (0 = embeddings)"
            )
        counts[i] = counts.get(i, 0) + 1
    return counts


def bound_pool(pool: str | None) -> str:
    """The pool ``kv_pools`` bound an attention layer to; a clear error if it was never called."""
    if pool is None:
        raise RuntimeError("the model's attention layers are not bound to a KV pool: call kv_pools() first")
    return pool


class PreNormDecoderLayer(nn.Module):
    """Pre-norm residual layer: ``h + self_attn(input_layernorm(h))``, then ``h + mlp(post_attention_layernorm(h))``.

    Subclasses build the four submodules; the attention takes ``(x, positions, rotary, ctx)``.
    """

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: AttentionContext
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, rotary, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """The base model under the LM head (``model.*`` in a checkpoint): ``embed_tokens``, the decoder
    ``layers``, the final ``norm`` and ``rotary_emb`` (no parameters or buffers: its float32 tables
    are rebuilt by ``reset_buffers()`` after loading)."""

    def __init__(
        self, config, layers: Iterable[nn.Module], rotary_emb: RotaryEmbedding, *, norm_unit_offset: bool = False
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, unit_offset=norm_unit_offset)
        self.rotary_emb = rotary_emb


class DecoderOnlyLM(PrepackedLMHead, nn.Module):
    """A decoder-only causal LM implementing :class:`specdec.models.CausalLM` around ``model``.

    ``text_config`` is the language-model part of a multimodal ``hf_config`` (default: the config
    itself). The default :meth:`kv_pools` is one GQA attention pool shaped by layer 0's attention.
    """

    required_block_size: int | None = None
    needs_custom_mask: bool = False

    def __init__(self, hf_config, model: nn.Module, text_config=None):
        super().__init__()
        text = hf_config if text_config is None else text_config
        self.hf_config = hf_config
        self.num_layers = text.num_hidden_layers
        self.hidden_size = text.hidden_size
        self.vocab_size = text.vocab_size
        # A multimodal checkpoint may record the tie on its outer config or on the text config.
        self.tie_word_embeddings = bool(
            getattr(hf_config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False)
        )
        self.model = model
        self.lm_head = None if self.tie_word_embeddings else VocabParallelHead(self.hidden_size, self.vocab_size)
        self.bind_vocab_group()

    # ----- cache -----
    def kv_pools(self, prefix: str, block_size: int, dtype: torch.dtype) -> list[KVPool]:
        """One pool named ``prefix`` holding every layer's KV, laid out as layer 0's attention keeps it
        (K/V heads, or an MLA latent); binds the layers to it."""
        attn = self.model.layers[0].self_attn
        pool = attn.kv_pool(prefix, num_layers=self.num_layers, block_size=block_size, dtype=dtype)
        self._bind_attention(prefix)
        return [pool]

    def kv_layer_slots(self) -> list[tuple[str, int]]:
        return [(bound_pool(layer.self_attn.pool), layer.self_attn.layer_idx) for layer in self.model.layers]

    def _bind_attention(self, pool: str) -> None:
        for layer in self.model.layers:
            layer.self_attn.pool = pool

    # ----- forward -----
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                aux_layer_ids: Sequence[int] = ()) -> ModelOutput:
        """Run the flattened varlen batch ``input_ids [T]`` at ``positions [T]``.

        ``aux_layer_ids`` selects residual streams to capture: id ``i`` is the stream entering layer
        ``i`` (0 = the embeddings), concatenated in ascending id order.
        """
        capture = self._check_aux_ids(aux_layer_ids)
        h = self.embed(input_ids)
        rotary = self.model.rotary_emb.at(positions)
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            captured.extend([h] * capture.get(i, 0))
            h = layer(h, positions, rotary, ctx)
        aux = torch.cat(captured, dim=-1) if captured else None
        return ModelOutput(hidden_states=self.model.norm(h), prenorm_hidden_states=h, aux_hidden_states=aux)

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _check_aux_ids(self, aux_layer_ids: Sequence[int]) -> dict[int, int]:
        return aux_capture_counts(aux_layer_ids, self.num_layers)

    # ----- weights -----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, weights, rename=self._checkpoint_name)

    def _checkpoint_name(self, name: str) -> str | None:
        return self._common_checkpoint_name(name)

    def _common_checkpoint_name(self, name: str, *, bare_model_prefix: bool = True) -> str | None:
        """The rules every architecture's checkpoints share.

        Older checkpoints saved RoPE tables: they are recomputed, never loaded. A tied LM head is the
        embedding matrix, whatever copy was saved. With ``bare_model_prefix``, a bare base-model
        checkpoint (``*Model.save_pretrained``, no ``model.`` prefix) loads too.
        """
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        if bare_model_prefix and not name.startswith(("model.", "lm_head.")):
            return "model." + name
        return name
