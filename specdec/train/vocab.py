"""A reduced draft vocabulary from token frequencies, and its ``d2t`` / ``t2d`` maps (FACTS.md section 3)."""

from __future__ import annotations

from typing import Sequence

import attrs
import torch


@attrs.frozen
class DraftVocab:
    """The target ids a draft can propose, ascending, with the maps the checkpoint stores.

    ``d2t[i] = target_ids[i] - i`` (offsets, so ``target = draft + d2t[draft]``); ``t2d`` marks the
    target ids present. The full vocabulary gives all-zero offsets (the identity map).
    """

    target_ids: torch.Tensor  # int64 [draft_vocab], ascending
    vocab_size: int

    @property
    def size(self) -> int:
        return int(self.target_ids.numel())

    @property
    def is_full(self) -> bool:
        return self.size == self.vocab_size

    @property
    def d2t(self) -> torch.Tensor:
        return self.target_ids - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask


def frequency_vocab(stream: torch.Tensor, vocab_size: int, draft_vocab_size: int | None,
                    always: Sequence[int] = ()) -> DraftVocab:
    """The ``draft_vocab_size`` most frequent ids of ``stream`` (ties to the lower id), plus ``always``.

    ``None`` or ``vocab_size`` keeps the whole vocabulary. ``always`` (e.g. EOS) is kept whatever
    its count, so the draft can still propose the end of a text.
    """
    if draft_vocab_size is None or draft_vocab_size == vocab_size:
        return DraftVocab(torch.arange(vocab_size, dtype=torch.int64), vocab_size)
    if not len(always) <= draft_vocab_size < vocab_size:
        raise ValueError(
            f"draft_vocab_size must be in [{len(always)}, {vocab_size}] (the target vocabulary), got {draft_vocab_size}"
        )
    counts = torch.bincount(stream.flatten(), minlength=vocab_size)[:vocab_size].to(torch.float64)
    counts[list(always)] = float("inf")
    # Stable sort on -count: equal counts keep ascending id order, so the choice is deterministic.
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    return DraftVocab(chosen.to(torch.int64), vocab_size)
