"""Which verifier checks a step's drafts, and the one call that runs it over the step's rows."""

from __future__ import annotations

import attrs
import torch

from specdec.runtime.layout import StepLayout
from specdec.sampling.sampler import Sampler, SamplingBatch
from specdec.verifiers.base import PAD_TOKEN_ID, Verifier
from specdec.verifiers.coupled import CoupledVerifier
from specdec.verifiers.greedy import GreedyVerifier
from specdec.verifiers.rejection import RejectionSampler


@attrs.frozen
class StepVerdict:
    """Per sampling request of a step (``layout.sampling`` order): drafts accepted, tokens emitted."""

    num_accepted: list[int]
    emitted: list[list[int]]
    verifier: str  # the name of the verifier that decided


class VerifierChoice:
    """The verifier of each step's drafts: ``fixed`` when the engine was given one, else
    :class:`GreedyVerifier` for an all-greedy step, :class:`CoupledVerifier` for deterministic drafts
    of a sampling step (no ``draft_probs``: the output is plain sampling's, token for token) and the
    lossless :class:`RejectionSampler` for drafts drawn from a distribution. Each treats greedy rows
    exactly like the greedy verifier, so per-request mixes are fine."""

    def __init__(self, sampler: Sampler, fixed: Verifier | None = None):
        self.fixed = fixed
        self._greedy = GreedyVerifier()
        self._coupled = CoupledVerifier(sampler)
        self._rejection = RejectionSampler()

    def needs_sampling_batch(self) -> bool:
        """Whether an all-greedy step with drafts still needs its :class:`SamplingBatch` (a fixed
        verifier may read it)."""
        return self.fixed is not None

    def pick(self, sampling: SamplingBatch | None, draft_probs: torch.Tensor | None) -> Verifier:
        if self.fixed is not None:
            return self.fixed
        if sampling is None:
            return self._greedy
        return self._rejection if draft_probs is not None else self._coupled

    def verify(self, logits: torch.Tensor, layout: StepLayout, draft_token_ids: list[list[int]],
               draft_probs: torch.Tensor | None, sampling: SamplingBatch | None, k: int) -> StepVerdict:
        """Verify the drafts of the step's sampling requests; ``logits`` are the verify rows'."""
        index = layout.sampling
        verifier = self.pick(sampling, draft_probs)
        if verifier is self._greedy:
            num_accepted, emitted = self._greedy.verify_lists(logits, [draft_token_ids[i] for i in index])
            return StepVerdict(num_accepted, emitted, verifier.name)
        device = logits.device
        padded = torch.tensor([draft_token_ids[i] + [PAD_TOKEN_ID] * (k - len(draft_token_ids[i])) for i in index],
                              device=device)
        num_drafts = torch.tensor([layout.num_drafts[i] for i in index], device=device)
        if draft_probs is not None and len(index) < layout.num_requests:
            draft_probs = draft_probs[torch.tensor(index, device=draft_probs.device)]
        result = verifier.verify(logits, padded, num_drafts, draft_probs, sampling)
        return StepVerdict(result.num_accepted.tolist(), result.emitted(), verifier.name)
