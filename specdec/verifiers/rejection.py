"""Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023), vectorised.

With p the target distribution and q the draft's at a position, draft x is accepted with
probability min(1, p(x) / q(x)); at the first rejection the emitted token is drawn from
norm(max(0, p - q)); when every draft is accepted the bonus token is drawn from p at the next
row. The emitted sequence then has exactly the law of sampling from p token by token.
"""

from __future__ import annotations

import torch

from specdec.sampling.processing import target_probs
from specdec.sampling.random import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE, categorical, uniform
from specdec.sampling.sampler import SamplingBatch
from specdec.verifiers.base import VerifyResult, accepted_prefix, assemble, check_inputs


class RejectionSampler:
    """Rejection-sampling verifier; greedy rows (temperature 0) reduce exactly to ``GreedyVerifier``.

    p comes from ``target_probs`` on the target logits with each request's parameters, the same
    processing the non-speculative sampler uses. Random numbers are keyed by (request seed, token
    position, stream): ``STREAM_ACCEPT`` for the accept test of the draft at position t,
    ``STREAM_RESIDUAL`` for a correction at t, ``STREAM_SAMPLE`` for a bonus at t. The bonus uses
    the plain sampler's stream, so a request with no drafts gets exactly the token ``Sampler``
    would give it.
    """

    name = "rejection"

    def verify(
        self,
        target_logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_drafts: torch.Tensor,
        draft_probs: torch.Tensor | None,
        batch: SamplingBatch | None,
    ) -> VerifyResult:
        if batch is None:
            raise ValueError("RejectionSampler needs the step's SamplingBatch (one row per request); got None")
        layout = check_inputs(target_logits, draft_token_ids, num_drafts, draft_probs, batch)
        num_req, k = draft_token_ids.shape
        num_drafts = num_drafts.to(torch.int64)
        drafts = layout.drafts

        per_token = batch.expand(num_drafts + 1)
        p = target_probs(target_logits, per_token.temperature, per_token.top_k, per_token.top_p)

        # Accept test at every draft slot (padding slots are masked out below).
        p_draft = p[layout.row_index[:, :k], drafts]
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2).to(p.dtype)
        positions = batch.counters.unsqueeze(1) + torch.arange(k, device=drafts.device)
        u = uniform(batch.seeds.repeat_interleave(k), positions.reshape(-1), STREAM_ACCEPT, 1).view(num_req, k)
        # u < p/q written without the division; q = 0 for a drawn draft cannot happen, and then
        # this accepts iff p > 0 (min(1, p/0) = 1).
        accept = layout.valid_draft & (u.to(p.dtype) * q_draft < p_draft)
        num_accepted = accepted_prefix(accept)

        rejected = num_accepted < num_drafts
        dist = p[layout.row_index.gather(1, num_accepted.unsqueeze(1)).squeeze(1)]  # [B, V]
        if k > 0 and bool(rejected.any()):
            slot = num_accepted.clamp(max=k - 1).unsqueeze(1)
            if draft_probs is None:
                q_slot = torch.zeros_like(dist).scatter_(1, drafts.gather(1, slot), 1.0)
            else:
                q_slot = draft_probs.gather(1, slot.unsqueeze(2).expand(-1, 1, dist.shape[1])).squeeze(1).to(dist.dtype)
            residual = (dist - q_slot).clamp(min=0)
            # Zero residual mass means p <= q everywhere, i.e. p == q up to rounding, where a
            # rejection had probability 0: p itself is then the right law.
            residual = torch.where((residual.sum(dim=1) > 0).unsqueeze(1), residual, dist)
            dist = torch.where(rejected.unsqueeze(1), residual, dist)

        # Greedy rows: dist is one-hot at the argmax (bonus) or a positive multiple of it (residual).
        final = dist.argmax(dim=-1)
        sampled = ~batch.greedy
        if bool(sampled.any()):
            rows = sampled.nonzero().squeeze(1)
            stream = torch.where(rejected, STREAM_RESIDUAL, STREAM_SAMPLE)[rows]
            final[rows] = categorical(dist[rows], batch.seeds[rows], (batch.counters + num_accepted)[rows], stream)
        return assemble(drafts, num_accepted, final)
