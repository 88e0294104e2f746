"""EAGLE3 / EAGLE3.1 draft training from a target's aux hidden states, with training-time test.

The draft is the serving module itself (:mod:`specdec.proposers.eagle3`, MHA or MLA), run through
:class:`~specdec.train.ttt.TTTContext` instead of the paged cache, so what is trained is exactly
what is served. Per batch of corpus windows:

1. the target (transformers, frozen) gives its aux hidden states (capture-before ids), its logits
   and, for the KV-sharing draft, one layer's K/V;
2. the draft runs ``ttt_steps`` unrolled steps: step 0 from ``fc`` of the aux states, each later
   step from the draft's own previous hidden state (``next_hidden``: pre-norm, post-norm with
   EAGLE3.1's ``norm_output``), reading the next token of the window;
3. the loss is the soft cross-entropy against the target's distribution restricted to the draft
   vocabulary, step ``j`` weighted ``step_decay ** j`` (0.8 in EAGLE3).

Shifted drafts (EAGLE3) see token ``p + 1`` with the target's hidden ``h_p`` at position ``p``;
unshifted drafts see token ``p`` with ``h_(p-1)`` (a zero bootstrap at position 0), FACTS.md
section 4. The KV-sharing draft additionally reads a target layer's K/V below a random per-window
split (the "prompt"), and is scored only at anchors past it.

Embedding: the target's (frozen, not saved). lm_head: the draft's own over the draft vocabulary,
or the target's rows of it (frozen, not saved). The checkpoint uses the ``layers.0.*`` layout with a
complete ``config.json``; ``load_eagle3_draft`` reads it.

Modules: :mod:`.presets` (what to train), :mod:`.hf_target` (the frozen target), :mod:`.build`
(config, module, checkpoint), :mod:`.loss` (the TTT forward), :mod:`.evaluate`, :mod:`.train`
(the run), :mod:`.throughput` (how fast it trains here).
"""

from specdec.train.draft.build import (
    build_draft,
    draft_config_dict,
    resolve_aux_layer_ids,
    resolve_kv_sharing_layer,
    save_draft,
)
from specdec.train.draft.evaluate import (
    DraftEval,
    evaluate_draft,
    replay_greedy_acceptance,
)
from specdec.train.draft.hf_target import HFTarget
from specdec.train.draft.loss import TTTOutput, ttt_forward
from specdec.train.draft.presets import (
    DRAFT_PRESETS,
    DraftPreset,
    get_draft_preset,
    register_draft_preset,
)
from specdec.train.draft.throughput import measure_draft_throughput
from specdec.train.draft.train import DraftTrainConfig, DraftTrainResult, train_draft

__all__ = [
    "DRAFT_PRESETS",
    "DraftEval",
    "DraftPreset",
    "DraftTrainConfig",
    "DraftTrainResult",
    "HFTarget",
    "TTTOutput",
    "build_draft",
    "draft_config_dict",
    "evaluate_draft",
    "get_draft_preset",
    "measure_draft_throughput",
    "register_draft_preset",
    "replay_greedy_acceptance",
    "resolve_aux_layer_ids",
    "resolve_kv_sharing_layer",
    "save_draft",
    "train_draft",
    "ttt_forward",
]
