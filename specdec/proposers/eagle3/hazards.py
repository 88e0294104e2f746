"""Load-time warnings for EAGLE3 drafts that load cleanly but cannot draft well for this target.

Shapes cannot catch these; each check warns (:func:`~specdec.proposers.load_warnings.warn`) rather
than refuses, because none is certain:

- :func:`check_shared_embedding`: EAGLE3 trainers copy the target's token embedding into the draft
  and freeze it (the EAGLE reference, SpecForge, whose HF export ships that copy, and
  :mod:`specdec.train`, which shares it without saving it). A draft that ships an embedding the size
  of the target's that differs from it was trained for another target. The LM head is not compared:
  trainers train it (SpecForge from scratch, specdec from the target's rows), so it differs by design.
- :func:`check_norm_output`: SpecForge up to 0.2.0 (before its PR #879, merged 2026-09-15) read
  ``norm_output`` only to decide whether the logits see the final norm; every training step fed the
  next one the pre-norm state, as EAGLE3 does. A draft it trained with ``norm_output: true`` is an
  EAGLE3 draft (what ``norm_output: false`` serves here), and one with an explicit ``norm_output: false``
  had its LM head trained on un-normed states, which no engine serves. SpecForge writes the flag at the
  top level of a ``LlamaForCausalLMEagle3`` config and records no version, so that spelling, without
  a ``training.json`` of this project's, is what the warning keys on.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.models.loader import read_config_json
from specdec.proposers.draft_record import RECORD_FILE
from specdec.proposers.load_warnings import warn

# Rows compared: enough to tell two embeddings apart, few enough for any vocabulary.
_SAMPLED_ROWS = 1024
# A copy of the target's rows in another dtype (bf16 of fp32, say) stays above this cosine.
_SAME_ROW = 0.99


@torch.no_grad()
def check_shared_embedding(where: str, draft, target) -> None:
    """Warn when ``draft`` ships an embedding shaped like ``target``'s that differs from it."""
    own = getattr(draft, "embed_tokens", None)
    if own is None or draft.hidden_size != target.hidden_size:
        return  # shared with the target, or a width of its own: nothing to compare
    ids = torch.arange(0, draft.vocab_size, max(1, draft.vocab_size // _SAMPLED_ROWS), device=draft.d2t.device)
    mine, theirs = draft.embed(ids).float(), target.embed(ids).float()
    close = F.cosine_similarity(mine, theirs, dim=-1) >= _SAME_ROW
    moved = int((~close).sum())
    if moved > ids.numel() // 20:
        warn(f"{where} ships its own embed_tokens, which EAGLE3 trainers copy from the target and freeze, but "
             f"{moved} of {ids.numel()} sampled rows differ from this target's: the draft was trained for another "
             "target, so acceptance may collapse")


def check_norm_output(where: str, path: str | Path) -> None:
    """Warn when the config spells ``norm_output`` as SpecForge <= 0.2.0 did while ignoring it in training."""
    raw = read_config_json(path)
    flag = raw.get("norm_output")
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    specforge_layout = "LlamaForCausalLMEagle3" in (raw.get("architectures") or []) and "norm_output" not in eagle
    if not isinstance(flag, bool) or not specforge_layout or (Path(path) / RECORD_FILE).is_file():
        return
    if flag:
        warn(f"{where} sets norm_output: true in SpecForge's layout; SpecForge up to 0.2.0 (before its PR #879) "
             "ignored it in training and fed each step the pre-norm state (EAGLE3), so a draft it trained serves "
             "as EAGLE3.1 with low acceptance beyond position 0: if so, set norm_output: false")
    else:
        warn(f"{where} sets norm_output: false in SpecForge's layout; SpecForge up to 0.2.0 (before its PR #879) "
             "then trained the LM head on un-normed states, which no engine serves: if acceptance is low at every "
             "position, retrain it with a fixed SpecForge")
