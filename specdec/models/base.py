"""What every target (and draft) model offers the engine, and the context its attention layers use."""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import attrs
import torch

from specdec.backends.base import AttentionBackend, AttentionMetadata
from specdec.backends.block_sparse import block_sparse_attention
from specdec.cache.paged_cache import PagedKVCache
from specdec.cache.pool import KVPool


@runtime_checkable
class AttentionContext(Protocol):
    """What an attention layer asks of the forward it runs in.

    Every per-token entry a layer keeps (K/V, an MLA latent, an indexer's keys) is written and read
    through the context, addressed by the name of the pool ``kv_pools`` bound the layer to and the
    layer's index in it; the layer never touches a backend or the cache. The built-ins are
    :class:`ForwardContext` (the paged cache, serving), :class:`~specdec.proposers.eagle3.kv_sharing.SharedKVContext`
    (a draft that also reads a target layer's KV) and :class:`~specdec.train.ttt.TTTContext` (training
    a draft on its own drafts, over dense windows, where only ``attend`` / ``attend_mla`` run).
    """

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
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` ``[T, kv_heads, D]`` for this step, then attend ``q [T, H, D]`` -> ``[T, H, Dv]``.

        ``key_mask`` (bool ``[T, G, max_seq_len]``) makes it block-sparse: query head group ``g`` of
        ``G`` contiguous groups sees only the keys ``key_mask[:, g]`` marks (see
        :func:`specdec.backends.block_sparse.block_sparse_attention`).
        """
        ...

    def attend_mla(
        self, pool: str, layer: int, q: torch.Tensor, latent: torch.Tensor, *, kv_lora_rank: int, scale: float
    ) -> torch.Tensor:
        """Write ``latent [T, kv_lora_rank + rope_dim]``, then absorbed MLA -> ``[T, H, kv_lora_rank]``."""
        ...

    def write(self, pool: str, layer: int, entries: Mapping[str, torch.Tensor]) -> None:
        """Store this step's ``entries[name]`` (``[T, *entry_shape]``) without attending over them."""
        ...

    def gather(self, pool: str, layer: int, entry: str) -> torch.Tensor:
        """Each request's cached ``entry`` rows, this step's included: ``[B, max_seq_len, *entry_shape]``."""
        ...

    def pool_metadata(self, pool: str) -> AttentionMetadata:
        """Where this forward's queries sit and each request's keys live in ``pool``."""
        ...


@attrs.define
class ForwardContext:
    """The :class:`AttentionContext` of a forward over the paged cache: which backend, which cache,
    and per-pool metadata; it writes each layer's new entries and runs the backend over them."""

    backend: AttentionBackend
    cache: PagedKVCache
    metadata: dict[str, AttentionMetadata]

    def attend(self, pool: str, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
               sliding_window: int | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.write(pool, layer, {"k": k, "v": v})
        paged, meta = self.cache.pool(pool), self.metadata[pool]
        kv, scales = paged.layer(layer), kv_scales(paged, layer, "k", "v")
        if key_mask is not None:
            return block_sparse_attention(
                self.backend, q, kv["k"], kv["v"], meta, key_mask, scale=scale, sliding_window=sliding_window, **scales
            )
        return self.backend.attention(q, kv["k"], kv["v"], meta, scale=scale, sliding_window=sliding_window, **scales)

    def attend_mla(
        self, pool: str, layer: int, q: torch.Tensor, latent: torch.Tensor, *, kv_lora_rank: int, scale: float
    ) -> torch.Tensor:
        self.write(pool, layer, {"latent": latent})
        paged = self.cache.pool(pool)
        return self.backend.mla_attention(q, paged.layer(layer)["latent"], self.metadata[pool], kv_lora_rank=kv_lora_rank,
                                          scale=scale, **kv_scales(paged, layer, "latent"))

    def write(self, pool: str, layer: int, entries: Mapping[str, torch.Tensor]) -> None:
        paged = self.cache.pool(pool)
        self.backend.write_kv(paged.layer(layer), paged.encode(layer, entries), self.metadata[pool].slot_mapping)

    def gather(self, pool: str, layer: int, entry: str) -> torch.Tensor:
        paged = self.cache.pool(pool)
        rows = self.backend.gather_pages(paged.layer(layer)[entry], self.metadata[pool])
        return paged.decode(layer, entry, rows, torch.float32)  # fp8 rows: exact in float32 (scale 1)

    def pool_metadata(self, pool: str) -> AttentionMetadata:
        return self.metadata[pool]


def kv_scales(pool: KVPool, layer: int, *entries: str) -> dict[str, float]:
    """The ``<entry>_scale`` keywords a backend's attention takes for ``layer`` of an fp8 ``pool``
    (none for a pool that stores values as they are)."""
    if not pool.quantized:
        return {}
    return {f"{entry}_scale": pool.scale(layer, entry) for entry in entries}


@attrs.frozen
class ModelOutput:
    """Per-token outputs of a forward, all ``[T, ...]`` over the flattened varlen batch."""

    hidden_states: torch.Tensor  # final hidden after the last norm (what the LM head reads)
    prenorm_hidden_states: torch.Tensor  # residual stream leaving the last layer, before the final norm
    aux_hidden_states: torch.Tensor | None = None  # [T, len(ids) * H], the captured layers in ascending order


@runtime_checkable
class PagedModel(Protocol):
    """What setting up the cache needs from a model with paged attention layers: a target
    (:class:`CausalLM`) or a draft head (EAGLE3)."""

    # Page size the architecture needs (MiniMax-M3's block-sparse attention: 128); None = any.
    required_block_size: int | None
    # Whether the attention needs a backend with ``custom_mask`` support (MiniMax-M3's block selection).
    needs_custom_mask: bool

    def kv_pools(self, prefix: str, block_size: int, dtype: torch.dtype) -> list[KVPool]:
        """Describe the pools the model needs (named ``prefix`` or ``prefix.<something>``) and bind its
        attention layers to them; the caller registers them in the cache. Calling it again rebinds."""
        ...


@runtime_checkable
class CausalLM(PagedModel, Protocol):
    """A causal LM over the paged cache.

    ``forward`` runs the flattened varlen batch. Hidden-state capture follows the capture-before
    convention: id ``i`` is the residual stream entering decoder layer ``i`` (id 0 = the
    embeddings), equal to transformers' ``output_hidden_states[i]`` for ``i < num_layers``.
    """

    hf_config: object
    num_layers: int
    hidden_size: int
    vocab_size: int

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        aux_layer_ids: Sequence[int] = (),
    ) -> ModelOutput: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab_size]`` of final (post-norm) hidden states (on every tensor-parallel rank)."""
        ...

    def greedy_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``argmax`` of :meth:`compute_logits` per row (first on ties), without gathering the logits."""
        ...

    def output_weight(self) -> torch.Tensor:
        """The ``[vocab_size, hidden_size]`` projection :meth:`compute_logits` applies: the LM head, or
        the embedding matrix when they are tied (what a draft without its own head shares). Under
        tensor parallelism, this rank's rows of the vocabulary padded to a multiple of the ranks."""
        ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def kv_layer_slots(self) -> list[tuple[str, int]]:
        """``(pool name, layer index in that pool)`` holding each decoder layer's KV, as
        :meth:`kv_pools` bound them: where a draft that shares a target layer's KV finds it."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """The weights (``torch.nn.Module.parameters``): their dtype and device are the model's."""
        ...


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE3's default capture ids (low, mid, high): ``(2, L // 2, L - 3)``."""
    return (2, num_layers // 2, num_layers - 3)


def config_max_len(model: "CausalLM") -> int:
    """The model config's ``max_position_embeddings`` (the default ``max_model_len``)."""
    value = getattr(model.hf_config, "max_position_embeddings", None)
    if not value:
        raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
    return int(value)
