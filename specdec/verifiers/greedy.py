"""Greedy verification: keep drafts while they equal the target's argmax."""

from __future__ import annotations

import torch

from specdec.sampling.processing import greedy_ids
from specdec.sampling.sampler import SamplingBatch
from specdec.verifiers.base import VerifyResult, accepted_prefix, assemble, check_inputs


class GreedyVerifier:
    """Accept draft j while it equals argmax of target row j; then emit the target's argmax.

    Every request is treated as greedy whatever its sampling parameters (``batch`` may be None);
    use ``RejectionSampler`` for batches that mix greedy and sampled requests.
    """

    name = "greedy"

    def verify(
        self,
        target_logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_drafts: torch.Tensor,
        draft_probs: torch.Tensor | None = None,
        batch: SamplingBatch | None = None,
    ) -> VerifyResult:
        layout = check_inputs(target_logits, draft_token_ids, num_drafts, draft_probs, batch)
        best = greedy_ids(target_logits)[layout.row_index]  # [B, k + 1]
        k = draft_token_ids.shape[1]
        num_accepted = accepted_prefix(layout.valid_draft & (layout.drafts == best[:, :k]))
        final = best.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
        return assemble(layout.drafts, num_accepted, final)
