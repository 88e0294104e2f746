"""The autoregressive draft chain both model-based proposers run (``draft_model`` and ``eagle3``).

From the draft's state at each drafting request's last known position (the hidden states its LM head
reads): draw a draft token (and, when any request samples and the proposer samples its drafts, the
distribution q it was drawn from),
keep the requests that may draft more, run one draft step for them on the tokens just drawn, and
repeat until every request has its ``limits[r]`` drafts. How a token is drawn and how a step runs are
the proposer's (``draw`` and ``advance``); a greedy draw needs no full logits (under tensor
parallelism it reduces each rank's best token instead of gathering the vocabulary).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from specdec.proposers.base import Proposal
from specdec.sampling.sampler import SamplingBatch

# (states [n, H], sampling rows or None when all greedy, draft index) -> (tokens [n], q [n, V] or None)
Draw = Callable[[torch.Tensor, "SamplingBatch | None", int], tuple[torch.Tensor, "torch.Tensor | None"]]
# (step: the draft index to produce next, kept: indices into the previous step's rows, rows: chain rows
#  still drafting, tokens: their last drafts) -> the states for draft ``step`` of those rows
Advance = Callable[[int, list[int], list[int], list[int]], torch.Tensor]


def draft_chain(
    seqs: Sequence,
    index: Sequence[int],
    limits: Sequence[int],
    states: torch.Tensor,
    draw: Draw,
    advance: Advance,
    *,
    batch_size: int,
    num_speculative_tokens: int,
    vocab_size: int,
    device: torch.device,
    sample: bool = True,
) -> Proposal:
    """Drafts for a step of ``batch_size`` requests, of which ``seqs`` (at ``index`` in the step) draft.

    ``states[r]`` are what ``draw`` reads for ``seqs[r]``'s first draft; ``limits[r] >= 1`` drafts at most. Greedy
    steps, and every step when ``sample`` is False (``draft_sample_method="greedy"``), draw the argmax with no
    random numbers and report no q (``draft_probs`` None: deterministic drafts).
    """
    drafts: list[list[int]] = [[] for _ in range(batch_size)]
    sampled = sample and not all(s.params.greedy for s in seqs)
    batch, probs = None, None  # all-greedy steps draft the argmax and need neither
    if sampled:
        batch = SamplingBatch.for_sequences(seqs, device)
        probs = torch.zeros(batch_size, num_speculative_tokens, vocab_size, dtype=torch.float64, device=device)
    rows = list(range(len(seqs)))  # chain rows still drafting
    step = 0
    while True:
        tokens, q = draw(states, batch, step)
        token_list = tokens.tolist()
        for r, token in zip(rows, token_list):
            drafts[index[r]].append(token)
        if q is not None:
            probs[torch.tensor([index[r] for r in rows]), step] = q.to(torch.float64)
        step += 1
        kept = [n for n, r in enumerate(rows) if limits[r] > step]
        if not kept:
            return Proposal(drafts, probs)
        if batch is not None and len(kept) < len(rows):
            batch = batch.select(torch.tensor(kept))
        rows = [rows[n] for n in kept]
        states = advance(step, kept, rows, [token_list[n] for n in kept])
