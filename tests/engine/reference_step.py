"""Speculative decoding as one readable function (in the manner of gpt-fast), the oracle the engine's
step is held to: batch 1, greedy, plain tensors, no cache (the target re-reads the whole sequence).

``target(ids) -> logits [len(ids), V]`` and ``draft(tokens, k) -> up to k token ids`` are plain
callables, so the oracle shares no code with the engine beyond the idea.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Target = Callable[[torch.Tensor], torch.Tensor]
Draft = Callable[[list[int], int], list[int]]


def speculative_decode(target: Target, draft: Draft, prompt: Sequence[int], k: int, max_tokens: int) -> list[dict]:
    """Greedy speculative decoding of ``max_tokens`` tokens after ``prompt``; one dict per step:
    ``draft_token_ids``, ``num_accepted``, ``emitted_token_ids`` (what the step appended)."""
    tokens, steps = list(prompt), []
    end = len(prompt) + max_tokens
    while len(tokens) < end:
        # Never draft past the end: the step emits its drafts' accepted prefix plus one token.
        proposed = draft(tokens, min(k, end - len(tokens) - 1))
        logits = target(torch.tensor(tokens + proposed))
        # Row len(tokens) - 1 + j predicts the token after drafts 0..j-1.
        best = logits[len(tokens) - 1 :].argmax(-1).tolist()
        accepted = 0
        while accepted < len(proposed) and proposed[accepted] == best[accepted]:
            accepted += 1
        emitted = proposed[:accepted] + [best[accepted]]
        tokens += emitted
        steps.append({"draft_token_ids": proposed, "num_accepted": accepted, "emitted_token_ids": emitted})
    return steps


def hf_target(model) -> Target:
    """A transformers causal LM as a ``Target`` (float64, no cache)."""

    def logits(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(ids[None]).logits[0]

    return logits


def hf_greedy_draft(model) -> Draft:
    """A transformers causal LM drafting greedily, one token at a time over the whole sequence."""
    run = hf_target(model)

    def draft(tokens: list[int], k: int) -> list[int]:
        out = []
        for _ in range(k):
            out.append(int(run(torch.tensor(tokens + out))[-1].argmax()))
        return out

    return draft
