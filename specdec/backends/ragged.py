"""A ragged batch split into groups of requests with close query lengths.

Code that pads every request's queries to the batch's longest does ``requests x max_query_len`` rows
of work: the torch backend's attention, MiniMax-M3's indexer scores. A batch mixing a prompt with
decoding requests is the common case under continuous batching, and there padding is most of the
work: a 96-token prompt beside 16 verifies of 4 queries pads 160 query rows to 1632, and on the zoo
MiniMax-M3 target that made the step's attention calls 2.5-3.5x as slow as the two batches run
apart. Decoding requests beside a few verifying ones are the other common case (an adaptive
controller gives drafts to some requests only): 15 decodes padded to one verify's 4 queries made
that call 1.4-1.7x the two groups' time. Requests sorted by query length and cut where padding would
exceed :data:`ALLOWANCE` rows plus :data:`SLACK` of the real ones keep the waste bounded; a batch
that wastes little stays one group.
"""

from __future__ import annotations

import itertools
from typing import Callable

import attrs
import torch

from specdec.backends.base import AttentionMetadata, AttentionOutput

# A group may pad its query rows by at most ALLOWANCE rows plus SLACK of the real ones: a padded query
# row costs about what a real one does (torch's CPU attention does not skip masked work), so little
# padding pays for the overhead of another call (benchmarks/bench_ragged.py).
SLACK = 1 / 16
ALLOWANCE = 4


@attrs.frozen
class QueryGroup:
    """Some of a batch's requests, in batch order, with their own layout."""

    requests: torch.Tensor  # int64 [b], indices into the batch
    tokens: torch.Tensor  # int64 [t], indices of their query tokens among the batch's
    meta: AttentionMetadata  # the group alone (no custom mask: callers add their rows of it)


def query_groups(meta: AttentionMetadata) -> list[QueryGroup] | None:
    """The batch cut into groups of close query lengths, or None when padding it whole wastes little.
    Computed once per forward (every layer shares it)."""
    return meta.derived("ragged.query_groups", _compute_query_groups)


def attend_in_groups(
    attend: Callable[[torch.Tensor, AttentionMetadata], AttentionOutput],
    q: torch.Tensor,
    meta: AttentionMetadata,
    *,
    return_lse: bool,
) -> AttentionOutput:
    """``attend(q, meta)``, run group by group when :func:`query_groups` cuts the batch, the outputs
    (and LSEs, with ``return_lse``) put back in token order. Each group sees its rows of the custom mask."""
    groups = query_groups(meta)
    if groups is None:
        return attend(q, meta)
    outs, lses = [], []
    for group in groups:
        sub = group.meta
        if meta.custom_mask is not None:
            sub = attrs.evolve(sub, custom_mask=meta.custom_mask[group.tokens])
        result = attend(q[group.tokens], sub)
        out, lse = result if return_lse else (result, None)
        outs.append(out)
        lses.append(lse)
    tokens = torch.cat([group.tokens for group in groups])
    out = _unpermute(torch.cat(outs), tokens)
    return (out, _unpermute(torch.cat(lses), tokens)) if return_lse else out


def _unpermute(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape).index_copy_(0, tokens, rows)


def _compute_query_groups(meta: AttentionMetadata) -> list[QueryGroup] | None:
    query_lens = meta.query_lens.tolist()
    if not _too_padded(len(query_lens), max(query_lens, default=0), sum(query_lens)):
        return None
    order = sorted(range(len(query_lens)), key=query_lens.__getitem__)
    cuts, rows = [[order[0]]], query_lens[order[0]]  # rows: the real query rows of the open cut
    for request in order[1:]:  # ascending, so this request is the open cut's longest
        length = query_lens[request]
        if _too_padded(len(cuts[-1]) + 1, length, rows + length):
            cuts.append([request])
            rows = length
        else:
            cuts[-1].append(request)
            rows += length
    starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    return [_group(meta, sorted(requests), starts, seq_lens) for requests in cuts]


def _too_padded(requests: int, longest: int, rows: int) -> bool:
    """Whether padding ``requests`` requests to the ``longest`` wastes more than the slack allows."""
    return requests * longest - rows > SLACK * rows + ALLOWANCE


def _group(meta: AttentionMetadata, requests: list[int], starts: list[int], seq_lens: list[int]) -> QueryGroup:
    device = meta.seq_lens.device
    tokens = list(itertools.chain.from_iterable(range(starts[i], starts[i + 1]) for i in requests))
    index = torch.tensor(requests, dtype=torch.int64, device=device)
    token_index = torch.tensor(tokens, dtype=torch.int64, device=device)
    sub = AttentionMetadata.build(
        query_lens=[starts[i + 1] - starts[i] for i in requests],
        seq_lens=[seq_lens[i] for i in requests],
        block_tables=meta.block_tables.index_select(0, index),
        slot_mapping=meta.slot_mapping.index_select(0, token_index),
        block_size=meta.block_size,
        causal=meta.causal,
    )
    return QueryGroup(requests=index, tokens=token_index, meta=sub)
