"""What the EAGLE3 proposer keeps of one request: the target's fused states the draft has not run over."""

from __future__ import annotations

from typing import Hashable

import attrs
import torch


@attrs.define
class RequestState:
    """The fused target states of one request and how far the draft has run over them.

    ``hidden`` holds fused target states (``[n, H]``) for hidden indices ``hidden_start ..
    hidden_start + n - 1``; ``done`` is how many hidden indices (from ``-position_offset``) the draft
    has run over with these true states. The last consumed row stays in ``hidden`` so a step with
    nothing new can re-run it.
    """

    hidden: torch.Tensor
    hidden_start: int
    done: int

    @property
    def known(self) -> int:
        """Hidden indices known so far: the target has computed positions ``< known``."""
        return self.hidden_start + self.hidden.shape[0]

    def take(self, request: Hashable, lo: int) -> torch.Tensor:
        """The states of hidden indices ``lo .. known - 1``, for a catch-up over them; the draft has then
        run over them all. Keeps only the last row (for a step that brings nothing new): a copy, so the
        prompt's states are released now rather than at the next step."""
        if lo < self.hidden_start:
            raise RuntimeError(
                f"EAGLE3 proposer lost track of request {request!r}: it needs the target state of position "
                f"{lo} but keeps them from {self.hidden_start}"
            )
        hi = self.known
        rows = self.hidden[lo - self.hidden_start :]
        self.done = hi
        self.hidden, self.hidden_start = self.hidden[hi - 1 - self.hidden_start :].clone(), hi - 1
        return rows

    def extend(self, request: Hashable, start: int, hidden: torch.Tensor) -> None:
        """Append the fused states of target positions ``start ..``; rows the target recomputed (from
        before ``known``) replace the ones kept."""
        if start > self.known:
            raise RuntimeError(
                f"EAGLE3 proposer is missing target states of request {request!r} for positions "
                f"{self.known}..{start - 1}"
            )
        if start < self.known:
            # Rows recomputed by the target (never in the current engine): theirs replace ours.
            if start < max(self.hidden_start, self.done - 1):
                raise RuntimeError(
                    f"EAGLE3 proposer: request {request!r} recomputed position {start}, before rows the draft "
                    "already consumed; free the request first"
                )
            self.hidden = self.hidden[: start - self.hidden_start]
            self.done = min(self.done, start)
        self.hidden = torch.cat([self.hidden, hidden])
