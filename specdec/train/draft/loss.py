"""The training-time-test forward: ``ttt_steps`` unrolled draft steps over a batch of windows, and its loss."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from specdec.proposers.eagle3.head import Eagle3Head
from specdec.train.draft.hf_target import HFTarget
from specdec.train.draft.presets import DraftPreset
from specdec.train.ttt import TTTContext
from specdec.train.vocab import DraftVocab


@attrs.frozen
class TTTOutput:
    loss: torch.Tensor  # weighted sum over steps
    step_losses: list[float]
    step_correct: list[int]  # draft argmax == target argmax, per step, over scored positions
    step_scored: list[int]
    step_log_probs: list[torch.Tensor] | None = None  # [B, S, draft_vocab] per step, when asked for
    step_hits: list[torch.Tensor] | None = None  # [B, S] bool per step: draft argmax == target argmax


def ttt_forward(draft: Eagle3Head, target: HFTarget, batch: torch.Tensor, preset: DraftPreset, vocab: DraftVocab,
                kv_layer: int | None, split: torch.Tensor | None, autocast: bool,
                keep_log_probs: bool = False, keep_hits: bool = False) -> TTTOutput:
    """The unrolled training-time-test loss of one batch of windows ``[B, S]`` (see the module docstring)."""
    B, S = batch.shape
    aux, logits, kv = target.run(batch, draft.aux_layer_ids, kv_layer)
    draft_ids = vocab.target_ids
    target_p = torch.softmax(logits[..., draft_ids], dim=-1)  # [B, S, Vd]
    target_top = logits.argmax(-1)  # [B, S] over the whole vocabulary
    index = torch.arange(S)
    offset = 0 if preset.unshifted else 1
    ctx = TTTContext(B, S, shared_kv=kv, split=split)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = draft.combine_aux(aux.flatten(0, 1)).view(B, S, -1)
        if preset.unshifted:
            # Position p reads h_(p-1); position 0 reads the zero bootstrap hidden state.
            hidden = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)
        hidden = hidden.flatten(0, 1)
        total = torch.zeros((), dtype=aux.dtype)
        step_losses, step_correct, step_scored, kept, hits = [], [], [], [], []
        for j in range(preset.ttt_steps):
            read = index + offset + j  # the token read, and the target position whose distribution is learnt
            valid = (read < S)[None, :].expand(B, S)
            if split is not None:
                valid = valid & (index[None, :] >= split[:, None])
            read = read.clamp(max=S - 1)
            ids = batch[:, read]
            positions = (index + j).repeat(B)
            post, hidden = draft(ids.flatten(), positions, hidden, ctx)
            logits_j = draft.compute_logits(post)
            log_q = F.log_softmax(logits_j.to(aux.dtype), dim=-1).view(B, S, -1)
            if keep_log_probs:
                kept.append(log_q.detach())
            p = target_p[:, read]
            scored = int(valid.sum())
            ce = -(p * log_q).sum(-1)
            loss_j = (ce * valid).sum() / max(scored, 1)
            total = total + preset.step_decay**j * loss_j
            with torch.no_grad():
                guess = draft_ids[log_q.argmax(-1)]
                hit = (guess == target_top[:, read]) & valid
                correct = int(hit.sum())
                if keep_hits:
                    hits.append(hit)
            step_losses.append(float(loss_j.detach()))
            step_correct.append(correct)
            step_scored.append(scored)
            ctx.next_step()
    return TTTOutput(total, step_losses, step_correct, step_scored, kept if keep_log_probs else None,
                     hits if keep_hits else None)


def random_splits(generator: torch.Generator, batch: int, seq: int, enabled: bool) -> torch.Tensor | None:
    """Per-window prompt lengths for KV-sharing training: uniform over ``[0, seq/2]`` (0 = no sharing)."""
    if not enabled:
        return None
    return torch.randint(0, seq // 2 + 1, (batch,), generator=generator)
