"""Coupled verification: speculative sampling that emits, token for token, what plain sampling emits.

At every verify row the target's token is drawn exactly as the plain :class:`~specdec.sampling.Sampler`
draws the token at that position: the same processing (``target_probs``) and the same random number,
keyed by (request seed, position, ``STREAM_SAMPLE``). Drafts are kept while they equal those draws;
the draw of the first row not matched is emitted (the bonus row's when every draft matched). Every
emitted token is then the plain sampler's token for its position given the same prefix, so by
induction a seeded request gives plain sampling's output exactly, whatever the drafts, k, the batch or
a preemption did (bit for bit where the target's logits are; FACTS.md section 2 on float64).

Each draft x is accepted with probability p(x): what rejection sampling gives a deterministic draft
(one-hot q). A draft drawn from a distribution q would be accepted with sum p q only, against
rejection sampling's sum min(p, q), so the engine keeps :class:`RejectionSampler` for drafts that
come with ``draft_probs`` and uses this verifier when none do.
"""

from __future__ import annotations

import torch

from specdec.sampling.sampler import Sampler, SamplingBatch
from specdec.verifiers.base import VerifyResult, accept_matching, check_inputs


class CoupledVerifier:
    """Accept draft j while it equals the plain sampler's draw for row j; then emit that row's draw.

    Greedy rows (temperature 0) draw the argmax, so they behave exactly like :class:`GreedyVerifier`.
    ``draft_probs`` is checked for shape and otherwise not read: the output never depends on the
    drafts, only how many tokens a step emits does.
    """

    name = "coupled"

    def __init__(self, sampler: Sampler | None = None):
        self.sampler = sampler or Sampler()

    def verify(
        self,
        target_logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_drafts: torch.Tensor,
        draft_probs: torch.Tensor | None,
        batch: SamplingBatch | None,
    ) -> VerifyResult:
        if batch is None:
            raise ValueError("CoupledVerifier needs the step's SamplingBatch (one row per request); got None")
        layout = check_inputs(target_logits, draft_token_ids, num_drafts, draft_probs, batch)
        # Row j of request b decides the token at position counters[b] + j: the plain sampler's draw there.
        drawn = self.sampler.sample(target_logits, batch.expand(num_drafts.to(torch.int64) + 1))
        return accept_matching(layout, drawn)
