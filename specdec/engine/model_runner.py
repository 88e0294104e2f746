"""Runs one model forward over the paged cache for a varlen batch of request chunks."""

from __future__ import annotations

from typing import Hashable, Sequence

import attrs
import torch

from specdec.backends.base import AttentionBackend, AttentionMetadata
from specdec.cache.paged_cache import PagedKVCache
from specdec.models.base import CausalLM, ForwardContext, ModelOutput


@attrs.frozen
class Chunk:
    """``token_ids`` of ``request`` to run now, continuing its cached tokens in the model's pools."""

    request: Hashable
    token_ids: Sequence[int]


class ModelRunner:
    """Owns one model's pools in the cache and turns request chunks into a forward.

    For each chunk it appends KV slots in every pool of the model, builds one
    :class:`AttentionMetadata` per pool (each pool with its own page size and block tables), and runs
    the model on the flattened batch. Positions continue each request's cached length.
    """

    def __init__(self, model: CausalLM, cache: PagedKVCache, backend: AttentionBackend, pool_names: Sequence[str]):
        self.model = model
        self.cache = cache
        self.backend = backend
        self.pool_names = list(pool_names)
        self.device = next(model.parameters()).device  # type: ignore[attr-defined]

    def forward(self, chunks: Sequence[Chunk], aux_layer_ids: Sequence[int] = ()) -> ModelOutput:
        ctx, positions = self.prepare(chunks)
        input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            return self.model.forward(input_ids, positions, ctx, aux_layer_ids)

    def prepare(self, chunks: Sequence[Chunk]) -> tuple[ForwardContext, torch.Tensor]:
        """Allocate slots for ``chunks`` in every pool and build the forward context and positions."""
        primary = self.pool_names[0]
        starts = [self.cache.num_tokens(c.request, primary) for c in chunks]
        query_lens = [len(c.token_ids) for c in chunks]
        slots: dict[str, list[torch.Tensor]] = {name: [] for name in self.pool_names}
        for chunk in chunks:
            for name, s in self.cache.append_slots(chunk.request, len(chunk.token_ids), self.pool_names).items():
                slots[name].append(s)
        requests = [c.request for c in chunks]
        seq_lens = [s + q for s, q in zip(starts, query_lens)]
        metadata = {
            name: AttentionMetadata.build(
                query_lens=query_lens,
                seq_lens=seq_lens,
                block_tables=self.cache.block_tables(requests, name).to(self.device),
                slot_mapping=_concat(slots[name]).to(self.device),
                block_size=self.cache.pool(name).block_size,
            )
            for name in self.pool_names
        }
        # One tensor from a flat list: cheaper than a cat of per-request aranges at decode batch sizes.
        positions = torch.tensor(
            [p for s, q in zip(starts, query_lens) for p in range(s, s + q)], dtype=torch.long, device=self.device
        )
        return ForwardContext(self.backend, self.cache, metadata), positions


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def last_token_indices(chunks: Sequence[Chunk]) -> torch.Tensor:
    """Row of each chunk's last token in the flattened batch."""
    lengths = torch.tensor([len(c.token_ids) for c in chunks])
    return lengths.cumsum(0) - 1
