"""Greedy verification: keep drafts while they equal the target's argmax."""

from __future__ import annotations

import torch

from specdec.sampling.processing import greedy_ids
from specdec.sampling.sampler import SamplingBatch
from specdec.verifiers.base import VerifyResult, accept_matching, check_inputs


class GreedyVerifier:
    """Accept draft j while it equals argmax of target row j; then emit the target's argmax.

    Every request is treated as greedy whatever its sampling parameters (``batch`` may be None);
    ``CoupledVerifier`` and ``RejectionSampler`` treat greedy rows exactly like this and sample the rest.
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
        return accept_matching(layout, greedy_ids(target_logits))
