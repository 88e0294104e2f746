"""Runs one model forward over the paged cache for a varlen batch of requests."""

from __future__ import annotations

from typing import Hashable, Sequence

import attrs
import torch

from specdec.backends.base import AttentionBackend, AttentionMetadata
from specdec.cache.paged_cache import PagedKVCache
from specdec.models.base import CausalLM, ForwardContext, ModelOutput
from specdec.runtime.layout import StepLayout


@attrs.frozen
class Chunk:
    """``token_ids`` of ``request`` to run now, continuing its cached tokens in the model's pools."""

    request: Hashable
    token_ids: Sequence[int]


def paged_metadata(
    cache: PagedKVCache,
    pool: str,
    requests: Sequence[Hashable],
    query_lens: Sequence[int],
    ends: Sequence[int],
    slot_mapping: torch.Tensor,
    device: torch.device,
) -> AttentionMetadata:
    """Attention metadata in ``pool`` for queries that are the last ``query_lens[i]`` positions before
    ``ends[i]`` of each request, their KV going to ``slot_mapping``.

    A request's keys are the positions it holds in the pool up to ``ends[i]`` (from its sequence start:
    a pool that keeps no prompt positions holds fewer keys than the logical length).
    """
    return AttentionMetadata.build(
        query_lens=list(query_lens),
        seq_lens=[end - cache.sequence_start(r, pool) for r, end in zip(requests, ends)],
        block_tables=cache.block_tables(requests, pool).to(device),
        slot_mapping=slot_mapping.to(device),
        block_size=cache.pool(pool).block_size,
    )


class ModelRunner:
    """Owns one model's pools in the cache and turns a step layout into a forward.

    For each request it appends KV slots in every pool of the model, builds one
    :class:`AttentionMetadata` per pool (each pool with its own page size and block tables), and runs
    the model on the flattened batch. ``pool_names[0]`` is the pool whose length is what a request has
    cached.
    """

    def __init__(self, model: CausalLM, cache: PagedKVCache, backend: AttentionBackend, pool_names: Sequence[str]):
        self.model = model
        self.cache = cache
        self.backend = backend
        self.pool_names = list(pool_names)
        self.device = next(model.parameters()).device

    def layout(self, chunks: Sequence[Chunk]) -> StepLayout:
        """The layout of ``chunks``: each continues its request's cached length."""
        primary = self.pool_names[0]
        return StepLayout.build(
            [c.request for c in chunks],
            [self.cache.num_tokens(c.request, primary) for c in chunks],
            [len(c.token_ids) for c in chunks],
            device=self.device,
        )

    def forward(self, chunks: Sequence[Chunk], aux_layer_ids: Sequence[int] = ()) -> ModelOutput:
        """Run ``chunks`` (each continuing its request); see :meth:`run`."""
        return self.run(self.layout(chunks), [c.token_ids for c in chunks], aux_layer_ids)

    def run(
        self, layout: StepLayout, token_ids: Sequence[Sequence[int]], aux_layer_ids: Sequence[int] = ()
    ) -> ModelOutput:
        """Run ``token_ids[i]`` of request ``layout.requests[i]`` at the layout's positions."""
        ctx = self.context(layout)
        input_ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            return self.model.forward(input_ids, layout.positions, ctx, aux_layer_ids)

    def prepare(self, chunks: Sequence[Chunk]) -> tuple[ForwardContext, torch.Tensor]:
        """Allocate slots for ``chunks`` in every pool; the forward context and the rows' positions."""
        layout = self.layout(chunks)
        return self.context(layout), layout.positions

    def context(self, layout: StepLayout) -> ForwardContext:
        """Allocate the layout's slots in every pool and build the forward context.

        A request whose rows start before its cached length *recomputes* those positions (their KV is
        in the cache, maybe in shared read-only pages; the rows run for their hidden states): their KV
        goes to scratch slots, the last of the ones appended, which are given back at once. Nothing
        reads them: the pages end before them, and a page freed here is written before it is read."""
        slots: dict[str, list[torch.Tensor]] = {name: [] for name in self.pool_names}
        primary = self.pool_names[0]
        give_back = []
        for request, start, rows in zip(layout.requests, layout.start_positions, layout.query_lens):
            recompute = self.cache.num_tokens(request, primary) - start
            appended = self.cache.append_slots(request, rows, self.pool_names)
            if recompute:
                give_back.append((request, start + rows))
            for name, s in appended.items():
                slots[name].append(torch.cat([s[rows - recompute :], s[: rows - recompute]]) if recompute else s)
        # Only after every request has its slots: a page given back must not go to another row of this forward.
        for request, length in give_back:
            self.cache.truncate(request, length, self.pool_names)
        ends = layout.seq_lens
        metadata = {
            name: paged_metadata(
                self.cache, name, layout.requests, layout.query_lens, ends, _concat(slots[name]), self.device
            )
            for name in self.pool_names
        }
        return ForwardContext(self.backend, self.cache, metadata)


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def last_token_indices(chunks: Sequence[Chunk]) -> torch.Tensor:
    """Row of each chunk's last token in the flattened batch."""
    lengths = torch.tensor([len(c.token_ids) for c in chunks])
    return lengths.cumsum(0) - 1
