"""``load_eagle3_draft``: build and load an EAGLE3 / EAGLE3.1 draft for a given target, or say why not.

Everything that would make a draft silently useless is checked against the target *before* any
weight is read: the aux-layer count and the fc width (an off-by-one here collapses acceptance without
any error), the vocabularies and the d2t map, the hidden sizes the shared embedding / lm_head need,
the 3.1 flags against the tensors present, and, for ``eagle3.1-mla``, that draft and target are MLA
with the same latent shape. What loads but is likely wrong (an embedding of another target, SpecForge's
ignored ``norm_output``) is warned about (:mod:`specdec.proposers.eagle3.hazards`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdec.models.layers import prepack_weights
from specdec.models.loader import CheckpointError, resolve_dtype
from specdec.models.weights import load_named_weights
from specdec.proposers.eagle3.checkpoint import canonical_name, checkpoint_shapes, iter_draft_tensors
from specdec.proposers.eagle3.config import Eagle3DraftConfig
from specdec.proposers.eagle3.hazards import check_norm_output, check_shared_embedding
from specdec.proposers.eagle3.head import Eagle3Head
from specdec.proposers.eagle3.model import Eagle3LlamaDraft

METHODS = ("eagle3", "eagle3.1-mla", "eagle3-unshifted")


def load_eagle3_draft(
    path: str | Path,
    target_model,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    *,
    method: str = "eagle3",
    shard_layer: bool = True,
) -> Eagle3Head:
    """Load the draft in folder ``path`` for ``target_model`` (a loaded specdec CausalLM).

    ``dtype="auto"`` and ``device=None`` take the target's. ``method`` is the speculative method the
    draft serves; ``"eagle3.1-mla"`` requires an MLA draft under an MLA target. Returns an
    :class:`~specdec.proposers.eagle3.model.Eagle3LlamaDraft` or
    :class:`~specdec.proposers.eagle3.mla_model.Eagle3MLADraft` in inference mode (no grad).
    Under tensor parallelism its decoder layer is this rank's shard (``shard_layer``) or whole.
    Raises :class:`~specdec.models.CheckpointError` naming the mismatch.
    """
    if method not in METHODS:
        raise ValueError(f"unknown EAGLE3 method {method!r}; choose one of {list(METHODS)}")
    where = f"EAGLE3 draft {str(path)!r}"
    try:
        config = Eagle3DraftConfig.from_folder(path)
    except CheckpointError:
        raise
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
    shapes = checkpoint_shapes(path)
    try:
        plan = _plan(config, shapes, target_model, method)
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None

    target_param = next(target_model.parameters())
    torch_dtype = target_param.dtype if dtype == "auto" else resolve_dtype(dtype, None)
    device = target_param.device if device is None else torch.device(device)
    cls = Eagle3LlamaDraft
    if config.attention == "mla":
        from specdec.proposers.eagle3.mla_model import Eagle3MLADraft  # needs the DeepSeek model module

        cls = Eagle3MLADraft
    with torch.device("meta"):
        draft = cls(config, **plan, shard_layer=shard_layer)
    draft.to_empty(device=device)
    draft.to(torch_dtype)
    for module in draft.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    load_named_weights(draft, iter_draft_tensors(path), rename=canonical_name)
    try:
        _finish_vocab_map(draft, has_d2t="d2t" in shapes, has_t2d="t2d" in shapes)
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None
    draft.share_target(target_model, None if plan["own_lm_head"] else _target_output_weight(target_model))
    check_shared_embedding(where, draft, target_model)
    check_norm_output(where, path)
    draft.requires_grad_(False)
    draft.eval()
    prepack_weights(draft)
    return draft


def _plan(config: Eagle3DraftConfig, shapes: dict[str, tuple[int, ...]], target, method: str) -> dict:
    """Check the draft against the target; returns the draft constructor's keyword arguments."""
    if method == "eagle3.1-mla":
        _check_mla_method(config, target)
    if not config.declares_eagle3 and "fc.weight" not in shapes:
        raise ValueError(
            "this is not an EAGLE3 draft: its config is a plain LlamaForCausalLM without draft_vocab_size or "
            "eagle_config, and it has no fc.weight; point the speculative config's model at the draft folder"
        )
    vocab, hidden = target.vocab_size, target.hidden_size
    if config.vocab_size != vocab:
        raise ValueError(
            f"the draft's vocab_size is {config.vocab_size} but the target's is {vocab}: it was made for another target"
        )
    if config.target_hidden_size is not None and config.target_hidden_size != hidden:
        raise ValueError(
            f"the draft's target_hidden_size is {config.target_hidden_size} but the target's hidden size is {hidden}"
        )
    aux_ids = config.resolve_aux_layer_ids(target.num_layers)
    _check_fc(config, shapes, hidden, aux_ids)
    _check_norm_tensors(config, shapes, len(aux_ids))
    if config.attention == "mla":
        _check_q_compression(config, shapes)
    own_embedding = "embed_tokens.weight" in shapes
    own_lm_head = "lm_head.weight" in shapes
    if own_embedding and shapes["embed_tokens.weight"] != (vocab, config.hidden_size):
        raise ValueError(
            f"embed_tokens.weight is {list(shapes['embed_tokens.weight'])}, expected [{vocab}, {config.hidden_size}] "
            "(target vocab x draft hidden)"
        )
    if not own_embedding and config.hidden_size != hidden:
        raise ValueError(
            f"the draft has no embed_tokens and its hidden_size {config.hidden_size} differs from the target's "
            f"{hidden}, so it cannot share the target's embedding"
        )
    if own_lm_head and shapes["lm_head.weight"] != (config.draft_vocab_size, config.hidden_size):
        raise ValueError(
            f"lm_head.weight is {list(shapes['lm_head.weight'])}, but the config says draft_vocab_size "
            f"{config.draft_vocab_size} x hidden_size {config.hidden_size}"
        )
    if not own_lm_head and config.hidden_size != hidden:
        raise ValueError(
            f"the draft has no lm_head and its hidden_size {config.hidden_size} differs from the target's "
            f"{hidden}, so it cannot share the target's lm_head"
        )
    if "d2t" in shapes and shapes["d2t"] != (config.draft_vocab_size,):
        raise ValueError(
            f"d2t has shape {list(shapes['d2t'])}, expected [{config.draft_vocab_size}] (draft_vocab_size)"
        )
    if "t2d" in shapes and shapes["t2d"] != (vocab,):
        raise ValueError(f"t2d has shape {list(shapes['t2d'])}, expected [{vocab}] (the target vocabulary)")
    if "d2t" not in shapes and config.draft_vocab_size < vocab:
        raise ValueError(
            f"draft_vocab_size {config.draft_vocab_size} < the target's vocab {vocab} but the checkpoint has no d2t "
            "map; without it draft ids cannot be turned into target ids (an identity map would be wrong)"
        )
    return {
        "aux_layer_ids": aux_ids,
        "target_hidden_size": hidden,
        "own_embedding": own_embedding,
        "own_lm_head": own_lm_head,
    }


def _check_mla_method(config: Eagle3DraftConfig, target) -> None:
    if config.attention != "mla":
        raise ValueError(
            f"method 'eagle3.1-mla' needs an MLA draft (Eagle3DeepseekV2ForCausalLM); this one is "
            f"{config.architecture} (MHA): use method 'eagle3'"
        )
    rank = getattr(target, "kv_lora_rank", None)
    if rank is None:
        raise ValueError(
            f"method 'eagle3.1-mla' puts the MLA draft in the target's MLA pool, but the target "
            f"({type(target).__name__}) has no MLA attention: use method 'eagle3', which gives the draft its own pool"
        )
    theirs = (rank, getattr(target, "qk_rope_head_dim", None))
    ours = (config.kv_lora_rank, config.qk_rope_head_dim)
    if theirs != ours:
        raise ValueError(
            f"the MLA draft's latent (kv_lora_rank {ours[0]} + rope {ours[1]}) differs from the target's "
            f"({theirs[0]} + {theirs[1]}), so it cannot live in the target's MLA pool"
        )


def _check_fc(config: Eagle3DraftConfig, shapes: dict[str, tuple[int, ...]], hidden: int, aux_ids) -> None:
    if "fc.weight" not in shapes:
        raise ValueError("the checkpoint has no fc.weight (the aux-state fusion); it is not an EAGLE3 draft")
    out_features, in_features = shapes["fc.weight"]
    expected = hidden * len(aux_ids)
    if in_features != expected:
        hint = ""
        if in_features % hidden == 0:
            hint = (
                f"; it fuses {in_features // hidden} layers: "
                "set eagle_config.eagle_aux_hidden_state_layer_ids to match"
            )
        raise ValueError(
            f"fc.weight takes {in_features} inputs but the target's hidden size {hidden} x {len(aux_ids)} aux layers "
            f"{list(aux_ids)} is {expected}{hint}"
        )
    if out_features != config.hidden_size:
        raise ValueError(f"fc.weight outputs {out_features} features, the draft's hidden_size is {config.hidden_size}")


def _check_norm_tensors(config: Eagle3DraftConfig, shapes: dict[str, tuple[int, ...]], num_aux: int) -> None:
    """fc_norm / norm_before_fc must agree with the tensors present: a loaded but unapplied norm is a known bug."""
    has_fc_norm = sorted(n for n in shapes if n.startswith("fc_norm."))
    if has_fc_norm and not config.fc_norm:
        raise ValueError(
            f"the checkpoint has {has_fc_norm[0]} but the config does not set fc_norm: true; set it (EAGLE3.1) "
            "so the per-layer norms are applied"
        )
    if config.fc_norm:
        missing = [f"fc_norm.{i}.weight" for i in range(num_aux) if f"fc_norm.{i}.weight" not in shapes]
        if missing:
            raise ValueError(f"the config sets fc_norm: true but the checkpoint lacks {', '.join(missing)}")
    if "input_norm.weight" in shapes and not config.norm_before_fc:
        raise ValueError(
            "the checkpoint has input_norm.weight but the config does not set norm_before_fc: true; set it so the "
            "norm over the concatenated aux states is applied"
        )
    if config.norm_before_fc and "input_norm.weight" not in shapes:
        raise ValueError("the config sets norm_before_fc: true but the checkpoint lacks input_norm.weight")


def _check_q_compression(config: Eagle3DraftConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """q_lora_rank (absent = no q compression) must match whether the draft has q_a_proj or q_proj."""
    q_a = shapes.get("midlayer.self_attn.q_a_proj.weight")
    if config.q_lora_rank is None and q_a is not None:
        raise ValueError(
            f"the config has no q_lora_rank but the checkpoint has q_a_proj {list(q_a)}; set q_lora_rank: {q_a[0]}"
        )
    if config.q_lora_rank is not None and "midlayer.self_attn.q_proj.weight" in shapes:
        raise ValueError(
            f"the config sets q_lora_rank {config.q_lora_rank} but the checkpoint has an uncompressed q_proj; "
            "set q_lora_rank: null"
        )


def _finish_vocab_map(draft: Eagle3Head, *, has_d2t: bool, has_t2d: bool) -> None:
    """Fill the identity map when there is none; check d2t names distinct, in-range target ids and t2d agrees."""
    vocab = draft.vocab_size
    if not has_d2t:
        draft.d2t.zero_()
    target_ids = torch.arange(draft.draft_vocab_size, device=draft.d2t.device) + draft.d2t
    if bool(((target_ids < 0) | (target_ids >= vocab)).any()):
        bad = int(target_ids[(target_ids < 0) | (target_ids >= vocab)][0])
        raise ValueError(f"d2t maps a draft id to target id {bad}, outside the target vocabulary 0..{vocab - 1}")
    if target_ids.unique().numel() != target_ids.numel():
        raise ValueError(
            "d2t maps two draft ids to the same target id; d2t holds offsets (target = draft + d2t[draft])"
        )
    mask = torch.zeros(vocab, dtype=torch.bool, device=draft.t2d.device)
    mask[target_ids] = True
    if has_t2d and not torch.equal(draft.t2d, mask):
        raise ValueError(
            f"t2d marks {int(draft.t2d.sum())} target ids but d2t maps to {draft.draft_vocab_size} ids, or to others; "
            "the two maps disagree"
        )
    draft.t2d.copy_(mask)


def _target_output_weight(target) -> torch.Tensor:
    """The target's ``[vocab, H]`` output projection: its lm_head, or the embedding when tied."""
    lm_head = getattr(target, "lm_head", None)
    if isinstance(lm_head, nn.Module) and getattr(lm_head, "weight", None) is not None:
        return lm_head.weight
    embed = getattr(getattr(target, "model", None), "embed_tokens", None)
    if isinstance(embed, nn.Module):
        return embed.weight
    raise CheckpointError(
        f"the draft has no lm_head and the target ({type(target).__name__}) exposes neither lm_head nor "
        "model.embed_tokens to share"
    )
