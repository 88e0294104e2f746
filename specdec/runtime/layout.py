"""``StepLayout``: where each request's rows sit in one forward, computed once and passed on.

A forward runs a varlen batch: request ``i`` contributes ``query_lens[i]`` rows, flattened request-major
from row ``row_starts[i]``, at positions ``start_positions[i] ..`` (continuing what it has cached). In a
speculative step the last ``num_drafts[i]`` of those rows are drafts, so its last ``num_drafts[i] + 1``
rows are the ones the verifier scores. A request whose rows are a chunk that ends before its last
token (chunked prefill) samples nothing: ``samples[i]`` is False and it has no verify rows. The engine builds the layout when it knows the step's tokens;
the model runner, the verifier's logits and the proposer's feedback all read it instead of
recomputing offsets.
"""

from __future__ import annotations

import functools
import itertools
from typing import Hashable, Sequence

import attrs
import torch


@attrs.frozen
class StepLayout:
    """One forward's rows per request (see the module docstring). Build with :meth:`build`."""

    requests: tuple[Hashable, ...]
    start_positions: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_drafts: tuple[int, ...]
    row_starts: tuple[int, ...]
    device: torch.device = attrs.field(eq=False)
    samples: tuple[bool, ...] = ()

    @classmethod
    def build(
        cls,
        requests: Sequence[Hashable],
        start_positions: Sequence[int],
        query_lens: Sequence[int],
        num_drafts: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
        samples: Sequence[bool] | None = None,
    ) -> "StepLayout":
        """The layout of ``requests`` running ``query_lens[i]`` rows from ``start_positions[i]``;
        ``num_drafts`` (default none) of each request's rows are drafts; ``samples`` (default all)
        says which requests sample a token from their last row (not a chunk ending mid-prompt)."""
        n = len(requests)
        drafts = tuple(num_drafts) if num_drafts is not None else (0,) * n
        sampled = tuple(bool(s) for s in samples) if samples is not None else (True,) * n
        if not len(start_positions) == len(query_lens) == len(drafts) == len(sampled) == n:
            raise ValueError("a step layout needs one start position, query length, draft count and samples flag "
                             "per request")
        if any(d < 0 or q < d + 1 for q, d in zip(query_lens, drafts)):
            raise ValueError("each request runs at least one row more than it has drafts")
        if any(d and not s for d, s in zip(drafts, sampled)):
            raise ValueError("a request with drafts samples (a chunk that ends mid-prompt carries no drafts)")
        row_starts = tuple(itertools.accumulate(query_lens, initial=0))[:n]
        return cls(tuple(requests), tuple(start_positions), tuple(query_lens), drafts, row_starts,
                   torch.device(device), sampled)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_rows(self) -> int:
        return sum(self.query_lens)

    @property
    def seq_lens(self) -> list[int]:
        """Each request's length after the forward (cached + this step's rows)."""
        return [s + q for s, q in zip(self.start_positions, self.query_lens)]

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """int64 ``[num_rows]``: the position of every row."""
        # One tensor from a flat list: cheaper than a cat of per-request aranges at decode batch sizes.
        flat = [p for s, q in zip(self.start_positions, self.query_lens) for p in range(s, s + q)]
        return torch.tensor(flat, dtype=torch.long, device=self.device)

    @functools.cached_property
    def sampling(self) -> tuple[int, ...]:
        """Indices of the requests that sample (all but chunks ending mid-prompt), in order."""
        return tuple(i for i, s in enumerate(self.samples) if s)

    @functools.cached_property
    def verify_rows(self) -> torch.Tensor:
        """int64 ``[sum(num_drafts + 1)]`` over the sampling requests: each one's last ``num_drafts + 1``
        rows, request-major (its last row alone when it has no drafts: the row that samples the next
        token)."""
        rows = [
            r
            for i in self.sampling
            for r in range(self.row_starts[i] + self.query_lens[i] - self.num_drafts[i] - 1,
                           self.row_starts[i] + self.query_lens[i])
        ]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def kept_rows(self, num_accepted: Sequence[int]) -> list[int]:
        """How many of each request's rows hold tokens that stay: all but its rejected drafts."""
        return [q - d + a for q, d, a in zip(self.query_lens, self.num_drafts, num_accepted)]
