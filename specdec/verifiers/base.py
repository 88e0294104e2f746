"""The Verifier protocol, its result format and the checks every verifier shares.

Input layout (one verify step over B requests, at most k drafts each):

- ``draft_token_ids`` int64 ``[B, k]``: request b's drafts in ``[b, :num_drafts[b]]``; the rest is
  padding (any value, e.g. -1) and is never read.
- ``num_drafts`` int64 ``[B]``, each in ``0..k``. A request with 0 drafts is a plain decode row.
- ``target_logits`` ``[sum(num_drafts + 1), V]``, request-major: request b owns
  ``num_drafts[b] + 1`` consecutive rows; row j of them is the target's prediction for the token
  after the last accepted token and drafts ``0..j-1`` (so row j scores draft j; the last row is
  for the bonus token).
- ``draft_probs`` ``[B, k, V]`` or None: the distribution each draft was *actually sampled from*,
  in the target's vocabulary (a sampling drafter builds it with ``specdec.sampling.target_probs``
  on its logits with the request's parameters, so p and q are processed alike). None means a
  deterministic drafter (n-gram, greedy draft model): q is one-hot at the draft.
- ``batch``: a ``SamplingBatch`` with one row per request whose ``counters[b]`` is the position of
  request b's first draft, i.e. of the first token emitted this step.

Output (``VerifyResult``): ``num_accepted[B]`` accepted drafts (a prefix), ``num_emitted[B] =
num_accepted + 1`` (the accepted drafts plus one correction or bonus token), and
``output_token_ids`` int64 ``[B, k + 1]`` holding the emitted tokens left-aligned, padded with -1.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import torch

from specdec.sampling.sampler import SamplingBatch

PAD_TOKEN_ID = -1


@attrs.frozen
class VerifyResult:
    """Per-request outcome of one verify step (format in the module docstring)."""

    num_accepted: torch.Tensor  # int64 [B]
    output_token_ids: torch.Tensor  # int64 [B, k + 1], -1 padded
    num_emitted: torch.Tensor  # int64 [B] = num_accepted + 1

    def emitted(self) -> list[list[int]]:
        """The emitted tokens of each request as Python lists (padding removed)."""
        rows = self.output_token_ids.tolist()
        return [row[:n] for row, n in zip(rows, self.num_emitted.tolist())]


@runtime_checkable
class Verifier(Protocol):
    """Decides which drafts to keep and which token to emit after them; vectorised over requests."""

    name: str

    def verify(
        self,
        target_logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_drafts: torch.Tensor,
        draft_probs: torch.Tensor | None,
        batch: SamplingBatch | None,
    ) -> VerifyResult: ...


@attrs.frozen
class VerifyLayout:
    """Index helpers for the request-major flattened target rows."""

    row_index: torch.Tensor  # int64 [B, k + 1]: flat row of (b, j), clamped to b's last row
    valid_draft: torch.Tensor  # bool [B, k]: j < num_drafts[b]
    drafts: torch.Tensor  # int64 [B, k]: draft ids with padding replaced by 0 (safe to gather)


def check_inputs(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch | None,
) -> VerifyLayout:
    """Validate the verify inputs (one-line errors naming the problem) and build the layout."""
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [B, k] (pad short rows), got shape {tuple(draft_token_ids.shape)}")
    num_req, k = draft_token_ids.shape
    if num_drafts.shape != (num_req,):
        raise ValueError(f"num_drafts must be [{num_req}] (one per request), got shape {tuple(num_drafts.shape)}")
    num_drafts = num_drafts.to(torch.int64)
    if num_req and (int(num_drafts.min()) < 0 or int(num_drafts.max()) > k):
        raise ValueError(f"num_drafts must lie in 0..{k} (the width of draft_token_ids), got {num_drafts.tolist()}")
    rows = int(num_drafts.sum()) + num_req
    if target_logits.dim() != 2 or target_logits.shape[0] != rows:
        raise ValueError(
            f"target_logits must be [sum(num_drafts + 1) = {rows}, V] (request-major), got {tuple(target_logits.shape)}"
        )
    vocab = target_logits.shape[1]
    j = torch.arange(k, device=draft_token_ids.device)
    valid = j.unsqueeze(0) < num_drafts.unsqueeze(1)
    ids = draft_token_ids.to(torch.int64)
    if bool((valid & ((ids < 0) | (ids >= vocab))).any()):
        raise ValueError(f"draft_token_ids hold ids outside the target vocabulary 0..{vocab - 1}")
    if draft_probs is not None and draft_probs.shape != (num_req, k, vocab):
        raise ValueError(
            f"draft_probs must be [B, k, V] = [{num_req}, {k}, {vocab}] or None, got {tuple(draft_probs.shape)}"
        )
    if batch is not None and len(batch) != num_req:
        raise ValueError(f"batch has {len(batch)} rows for {num_req} requests; build it with one row per request")
    starts = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    jj = torch.arange(k + 1, device=draft_token_ids.device)
    row_index = starts.unsqueeze(1) + torch.minimum(jj.unsqueeze(0), num_drafts.unsqueeze(1))
    return VerifyLayout(row_index=row_index, valid_draft=valid, drafts=torch.where(valid, ids, 0))


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of a bool ``[B, k]`` tensor."""
    return accept.to(torch.int64).cumprod(dim=1).sum(dim=1)


def accept_matching(layout: VerifyLayout, chosen: torch.Tensor) -> VerifyResult:
    """Keep drafts while they equal the target's own choice at their row (``chosen``: one token per
    flattened target row, e.g. the argmax or the plain sampler's draw); then emit the choice of the
    first row not matched (a correction, or the bonus after every draft)."""
    per_slot = chosen[layout.row_index]  # [B, k + 1]
    k = layout.drafts.shape[1]
    num_accepted = accepted_prefix(layout.valid_draft & (layout.drafts == per_slot[:, :k]))
    final = per_slot.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return assemble(layout.drafts, num_accepted, final)


def assemble(drafts: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> VerifyResult:
    """Emitted tokens: accepted drafts, then ``final_token`` at slot ``num_accepted``, then -1."""
    num_req, k = drafts.shape
    out = torch.full((num_req, k + 1), PAD_TOKEN_ID, dtype=torch.int64, device=drafts.device)
    slots = torch.arange(k + 1, device=drafts.device).unsqueeze(0)
    out[:, :k] = torch.where(slots[:, :k] < num_accepted.unsqueeze(1), drafts, PAD_TOKEN_ID)
    out.scatter_(1, num_accepted.unsqueeze(1), final_token.unsqueeze(1))
    return VerifyResult(num_accepted=num_accepted, output_token_ids=out, num_emitted=num_accepted + 1)
