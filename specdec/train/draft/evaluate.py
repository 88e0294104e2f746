"""Draft evaluation: teacher-forced agreement, and greedy acceptance replayed as the engine steps."""

from __future__ import annotations

import attrs
import torch

from specdec.train.draft.loss import ttt_forward
from specdec.train.draft.presets import DraftPreset
from specdec.train.vocab import DraftVocab


@attrs.frozen
class DraftEval:
    agreement: list[float]  # per step: draft argmax == target argmax (teacher-forced)
    acceptance: list[float]  # per position < k: greedy acceptance replayed at the engine's anchors

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + sum(self.acceptance)


def replay_greedy_acceptance(hits: list[torch.Tensor], first_anchor: int, k: int, offset: int) -> tuple[list[int], int]:
    """Greedy speculation replayed over teacher-forced hits ``[B, S]`` per step, as the engine steps.

    From anchor ``first_anchor`` each engine step drafts ``k`` tokens, accepts the leading hits ``n``
    and moves the anchor by ``n + 1``. On text the target generated greedily this is exactly what
    serving does (the drafts it accepts are the tokens the windows hold). Returns per-position
    accepted counts and the number of drafting steps (vLLM's ``accepted_per_position`` and
    ``num_drafts``). Uniform averaging over anchors would overstate acceptance: the engine skips
    quickly through easy stretches and lingers in hard ones.
    """
    batch, seq = hits[0].shape
    stacked = torch.stack(hits[:k], dim=-1).tolist()  # [B][S][k]
    accepted, drafts = [0] * k, 0
    for row in stacked:
        anchor = first_anchor
        while anchor + offset + k - 1 < seq:
            n = 0
            while n < k and row[anchor][n]:
                n += 1
            for j in range(n):
                accepted[j] += 1
            drafts += 1
            anchor += n + 1
    return accepted, drafts


@torch.no_grad()
def evaluate_draft(draft, target, val: torch.Tensor, preset: DraftPreset, vocab: DraftVocab, kv_layer,
                   autocast: bool, prompt_len: int | None = None, k: int = 3) -> DraftEval:
    """Per-step agreement on fixed validation windows, and greedy acceptance at ``k`` drafts per step.

    On windows the target generated greedily after ``prompt_len`` corpus tokens, ``acceptance[j]``
    is vLLM's acceptance at position ``j`` for greedy speculation over that text (see
    :func:`replay_greedy_acceptance`). The KV-sharing draft shares ``prompt_len`` tokens (default:
    half of each window).
    """
    draft.eval()
    steps = preset.ttt_steps
    k = min(k, steps)
    correct, scored = [0] * steps, [0] * steps
    accepted, drafts = [0] * k, 0
    shared = prompt_len if prompt_len is not None else preset.seq_len // 2
    offset = 0 if preset.unshifted else 1
    # Serving's first anchor after a prompt of P tokens: row P - 1 (shifted) or P (unshifted).
    first_anchor = shared - offset if prompt_len is not None else 0
    for start in range(0, val.shape[0], preset.batch_size):
        chunk = val[start : start + preset.batch_size]
        split = torch.full((chunk.shape[0],), shared) if kv_layer is not None else None
        out = ttt_forward(draft, target, chunk, preset, vocab, kv_layer, split, autocast, keep_hits=True)
        for j in range(steps):
            correct[j] += out.step_correct[j]
            scored[j] += out.step_scored[j]
        acc, n = replay_greedy_acceptance(out.step_hits, max(first_anchor, 0), k, offset)
        accepted = [a + b for a, b in zip(accepted, acc)]
        drafts += n
    draft.train()
    return DraftEval([c / max(s, 1) for c, s in zip(correct, scored)], [a / max(drafts, 1) for a in accepted])
