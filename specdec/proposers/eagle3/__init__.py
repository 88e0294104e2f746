"""EAGLE3 / EAGLE3.1 draft models (MHA and MLA), loaded from the checkpoint layouts people publish.

Load one with :func:`load_eagle3_draft(path, target, dtype="auto", device=None, method="eagle3")
<specdec.proposers.eagle3.loading.load_eagle3_draft>`. It returns an :class:`Eagle3LlamaDraft`
(MHA/GQA layer) or an :class:`Eagle3MLADraft` (DeepSeek MLA layer), chosen from the draft's config.

Module API (what a proposer drives; all tensors are ``[T, ...]`` over a flattened varlen batch):

- ``aux_layer_ids: tuple[int, ...]`` target layers to capture, ascending, capture-before (id ``i`` =
  the residual stream entering target layer ``i``; 0 = embeddings). From
  ``eagle_config.eagle_aux_hidden_state_layer_ids``, else ``(2, L//2, L-3)`` of the target's ``L``.
  Pass them as the target forward's ``aux_layer_ids``. (SGLang adds 1 to explicit ids whose first id
  is 1; this package, like vLLM and EAGLE, reads them as written.)
- ``combine_aux(aux_hidden [T, n * H_target]) -> [T, H]``: fc_norm per chunk (3.1) or the
  norm_before_fc norm, then ``fc``. Only for positions that have the target's hidden states; from the
  second draft step on, feed back the draft's own ``next_hidden`` and skip this.
- ``forward(input_ids [T], positions [T], hidden [T, H], ctx) -> (logits_hidden, next_hidden)``:
  ``logits_hidden`` is post-norm (for ``compute_logits``); ``next_hidden`` is the pre-norm state, or
  the post-norm one when the config sets ``norm_output`` (3.1). ``input_ids`` are *target* ids.
  Shifted prefill: the draft at position ``p`` gets token ``p + 1`` and ``combine_aux(h_p)``.
- ``compute_logits(logits_hidden) -> [T, draft_vocab_size]`` draft-vocabulary logits.
- ``draft_to_target(draft_ids) -> target ids`` via ``d2t`` (``target = draft + d2t[draft]``);
  ``target_logits(draft_logits) -> [T, vocab_size]`` with ``-inf`` outside the draft vocabulary (for
  sampled drafts' q); buffers ``d2t`` (int64 ``[draft_vocab]``) and ``t2d`` (bool ``[vocab]``).
- ``hidden_size``, ``target_hidden_size``, ``vocab_size`` (the target's), ``draft_vocab_size``,
  ``norm_output``, ``is_mla``, ``num_layers`` (1), ``required_block_size`` (None), ``config``
  (:class:`Eagle3DraftConfig`).
- Pools. MHA: ``kv_pools(prefix, block_size, dtype) -> [AttentionPool]``, one layer named ``prefix``
  with its own page size (never the target's). MLA: ``kv_pools`` likewise gives an own single-layer
  ``MLAPool`` (for a non-MLA target under ``eagle3``); under an MLA target call
  ``join_pool(target_mla_pool) -> layer index`` before the cache is built (it reserves
  ``mla_pool_layers()`` = 1 extra layer there and binds the draft), or ``bind_pool(pool, layer)`` for
  a layer reserved by hand; ``check_pool(pool)`` raises unless the latent shape matches.
  With a pool of its own, run the draft with a :class:`~specdec.runtime.model_runner.ModelRunner`
  over its pool names: ``ctx, positions = runner.prepare(chunks)``, then
  ``draft(ids, positions, hidden, ctx)``. In the target's MLA pool the draft's row for position ``p``
  sits in the target's slot for ``p`` (shifted prefill keeps draft and target positions aligned), so
  build that pool's :class:`~specdec.backends.base.AttentionMetadata` from the target's block table
  instead of appending slots (tests/proposers/test_eagle3_model.py ``_metadata`` shows how).

Embedding and lm_head: the checkpoint's when present, else the target's (the lm_head rows of the
draft vocabulary), shared, not copied.
"""

from specdec.proposers.eagle3.config import Eagle3DraftConfig
from specdec.proposers.eagle3.head import Eagle3Head
from specdec.proposers.eagle3.loading import METHODS, load_eagle3_draft
from specdec.proposers.eagle3.model import Eagle3LlamaDraft

__all__ = ["METHODS", "Eagle3DraftConfig", "Eagle3Head", "Eagle3LlamaDraft", "Eagle3MLADraft", "load_eagle3_draft"]


def __getattr__(name: str):
    # The MLA draft imports the DeepSeek-V3 model module; load it only when asked for.
    if name == "Eagle3MLADraft":
        from specdec.proposers.eagle3.mla_model import Eagle3MLADraft

        return Eagle3MLADraft
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
