"""What every target (and draft) model offers the engine, and the context its attention layers use."""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence, runtime_checkable

import attrs
import torch

from specdec.backends.base import AttentionBackend, AttentionMetadata
from specdec.cache.paged_cache import PagedKVCache
from specdec.cache.pool import PagedPool


@attrs.define
class ForwardContext:
    """The attention side of one forward: which backend, which cache, and per-pool metadata.

    Attention layers call :meth:`attend` / :meth:`attend_mla` with the name of the pool that holds
    their KV and their layer index inside it; the context writes the new KV and runs the backend.
    """

    backend: AttentionBackend
    cache: PagedKVCache
    metadata: dict[str, AttentionMetadata]

    def attend(
        self,
        pool: str,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` ``[T, kv_heads, D]`` for this step, then attend ``q [T, H, D]`` -> ``[T, H, Dv]``."""
        kv = self.cache.pool(pool).layer(layer)
        meta = self.metadata[pool]
        self.backend.write_kv(kv, {"k": k, "v": v}, meta.slot_mapping)
        return self.backend.attention(q, kv["k"], kv["v"], meta, scale=scale, sliding_window=sliding_window)

    def attend_mla(
        self,
        pool: str,
        layer: int,
        q: torch.Tensor,
        latent: torch.Tensor,
        *,
        kv_lora_rank: int,
        scale: float,
    ) -> torch.Tensor:
        """Write ``latent [T, kv_lora_rank + rope_dim]``, then absorbed MLA -> ``[T, H, kv_lora_rank]``."""
        kv = self.cache.pool(pool).layer(layer)
        meta = self.metadata[pool]
        self.backend.write_kv(kv, {"latent": latent}, meta.slot_mapping)
        return self.backend.mla_attention(q, kv["latent"], meta, kv_lora_rank=kv_lora_rank, scale=scale)


@attrs.frozen
class ModelOutput:
    """Per-token outputs of a forward, all ``[T, ...]`` over the flattened varlen batch."""

    hidden_states: torch.Tensor  # final hidden after the last norm (what the LM head reads)
    prenorm_hidden_states: torch.Tensor  # residual stream leaving the last layer, before the final norm
    aux_hidden_states: torch.Tensor | None = None  # [T, len(ids) * H], the captured layers in ascending order


@runtime_checkable
class CausalLM(Protocol):
    """A causal LM over the paged cache.

    ``kv_pools(prefix, block_size, dtype)`` describes the pools the model needs (named ``prefix`` or
    ``prefix.<something>``) and binds the model's attention layers to them; the engine registers them
    in the cache. ``forward`` runs the flattened varlen batch. Hidden-state capture follows the
    capture-before convention: id ``i`` is the residual stream entering decoder layer ``i`` (id 0 =
    the embeddings), equal to transformers' ``output_hidden_states[i]`` for ``i < num_layers``.
    """

    hf_config: object
    num_layers: int
    hidden_size: int
    vocab_size: int
    # Page size the architecture needs (MiniMax-M3's block-sparse attention: 128); None = any.
    required_block_size: int | None
    # Whether the attention needs a backend with ``custom_mask`` support (MiniMax-M3's block selection).
    needs_custom_mask: bool

    def kv_pools(self, prefix: str, block_size: int, dtype: torch.dtype) -> list[PagedPool]: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        aux_layer_ids: Sequence[int] = (),
    ) -> ModelOutput: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE3's default capture ids (low, mid, high): ``(2, L // 2, L - 3)``."""
    return (2, num_layers // 2, num_layers - 3)
