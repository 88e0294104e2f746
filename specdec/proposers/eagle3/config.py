"""``Eagle3DraftConfig``: what an EAGLE3 / EAGLE3.1 draft folder's ``config.json`` says, validated.

The published drafts spell the same things in different places (FACTS.md section 3): the EAGLE
reference writes ``architectures: ["LlamaForCausalLM"]`` plus ``draft_vocab_size``; SGLang /
SpecForge write ``LlamaForCausalLMEagle3`` with an ``eagle_config`` block; MLA drafts are
``Eagle3DeepseekV2ForCausalLM``. The 3.1 flags (``fc_norm``, ``norm_output``) and the other norm
switches (``norm_before_residual``, ``norm_before_fc``) may sit at the top level or inside
``eagle_config``. This module folds all of that into one frozen record, so the model code reads one
spelling and every flag is either honoured or rejected, never dropped.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any, Mapping

import attrs
from transformers import DeepseekV3Config, LlamaConfig

from specdec.models.base import default_aux_layer_ids
from specdec.models.loader import read_config_json

# Architectures of MHA (Llama-style) drafts. Plain "LlamaForCausalLM" is the EAGLE reference's
# spelling; it only counts as a draft with a draft_vocab_size / eagle_config or an fc weight.
MHA_ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
_FLAGS = ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc")


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"draft config: {attribute.name} must be a positive integer, got {value!r}")


def _optional_positive(instance, attribute, value) -> None:
    if value is not None:
        _positive(instance, attribute, value)


def _aux_ids(instance, attribute, value) -> None:
    if value is None:
        return
    if not value or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in value) or \
            len(set(value)) != len(value):
        raise ValueError(
            f"draft config: eagle_config.eagle_aux_hidden_state_layer_ids must be a non-empty list of distinct "
            f"layer ids >= 0, got {list(value)!r}"
        )


@attrs.frozen
class Eagle3DraftConfig:
    """An EAGLE3 draft's architecture, as parsed from its ``config.json``.

    ``attention`` is ``"mha"`` (Llama-style GQA layer) or ``"mla"`` (DeepSeek MLA layer).
    ``aux_layer_ids`` is the explicit ``eagle_config.eagle_aux_hidden_state_layer_ids`` in ascending
    order (engines concatenate the captured states in ascending layer order), or None for the default
    ``(2, L // 2, L - 3)`` of the *target's* layer count (see :meth:`resolve_aux_layer_ids`); ids
    follow the capture-before convention (id ``i`` = the residual stream entering target layer ``i``).
    ``target_hidden_size`` is None when the config does not declare one. ``hf_config`` is the
    transformers config object the RoPE tables are built from.
    """

    architecture: str
    attention: str = attrs.field(validator=attrs.validators.in_(("mha", "mla")))
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_attention_heads: int = attrs.field(validator=_positive)
    num_key_value_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    rms_norm_eps: float
    hidden_act: str
    vocab_size: int = attrs.field(validator=_positive)
    draft_vocab_size: int = attrs.field(validator=_positive)
    target_hidden_size: int | None = attrs.field(validator=_optional_positive)
    aux_layer_ids: tuple[int, ...] | None = attrs.field(validator=_aux_ids)
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # True when the config itself says "EAGLE3" (architecture, draft_vocab_size or eagle_config).
    declares_eagle3: bool = True
    # MLA only.
    q_lora_rank: int | None = attrs.field(default=None, validator=_optional_positive)
    kv_lora_rank: int | None = attrs.field(default=None, validator=_optional_positive)
    qk_nope_head_dim: int | None = attrs.field(default=None, validator=_optional_positive)
    qk_rope_head_dim: int | None = attrs.field(default=None, validator=_optional_positive)
    v_head_dim: int | None = attrs.field(default=None, validator=_optional_positive)
    rope_interleave: bool = True
    # Carried through to config.json unchanged (the serving model reads RoPE through hf_config).
    rope_parameters: dict | None = None
    max_position_embeddings: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    dtype: str | None = None
    # Unshifted drafts (specdec.proposers.eagle3.unshifted): eagle_config.unshifted, bootstrap_hidden,
    # kv_sharing_target_layers.
    unshifted: bool = False
    bootstrap_hidden: str | None = None
    kv_sharing_target_layers: dict | None = None
    hf_config: Any = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.fc_norm and self.norm_before_fc:
            raise ValueError(
                "draft config sets both fc_norm (one RMSNorm per aux chunk) and norm_before_fc (one RMSNorm "
                "over the whole concatenation); they are exclusive: keep the one the draft was trained with"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft config: draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size}); "
                "the draft vocabulary must be a subset of the target's"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"draft config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.attention == "mla":
            missing = [
                name
                for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(f"MLA draft config ({self.architecture}) lacks {', '.join(missing)}")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"draft config: qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        elif self.head_dim % 2:
            raise ValueError(f"draft config: head_dim must be even for RoPE, got {self.head_dim}")

    # ----- construction -----
    @classmethod
    def from_folder(cls, path: str | Path) -> "Eagle3DraftConfig":
        """Parse ``path/config.json``."""
        return cls.from_dict(read_config_json(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Eagle3DraftConfig":
        """Parse a draft ``config.json`` object; raises ValueError naming what is wrong."""
        raw = dict(raw)
        architecture = _architecture(raw)
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, Mapping):
            raise ValueError(f"draft config: eagle_config must be an object, got {type(eagle).__name__}")
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ValueError(
                "draft config: eagle_config.use_aux_hidden_state is false, i.e. an EAGLE-1/2 style head without "
                "aux hidden states; only EAGLE3 / EAGLE3.1 drafts are supported"
            )
        declares = architecture != "LlamaForCausalLM" or "draft_vocab_size" in raw or "eagle_config" in raw
        num_layers = raw.get("num_hidden_layers", 1)
        if num_layers != 1 and not declares:
            raise ValueError(
                f"this is not an EAGLE3 draft: its config is a plain LlamaForCausalLM with {num_layers} layers and no "
                "draft_vocab_size or eagle_config; point the speculative config's model at the draft folder"
            )
        if num_layers != 1:
            raise ValueError(
                f"draft config: num_hidden_layers is {num_layers!r}; EAGLE3 drafts have exactly one decoder layer"
            )
        flags = {name: _flag(raw, eagle, name) for name in _FLAGS}
        is_mla = architecture in MLA_ARCHITECTURES
        if not is_mla and raw.get("kv_lora_rank") is not None:
            raise ValueError(
                f"draft config: architecture {architecture!r} is a Llama-style (MHA) draft but the config has "
                f"kv_lora_rank; MLA drafts are {list(MLA_ARCHITECTURES)}"
            )
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and not isinstance(ids, (list, tuple)):
            raise ValueError(f"draft config: eagle_aux_hidden_state_layer_ids must be a list, got {ids!r}")
        hidden = raw.get("hidden_size")
        heads = raw.get("num_attention_heads")
        vocab = raw.get("vocab_size")
        for name, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("vocab_size", vocab)):
            if value is None:
                raise ValueError(f"draft config lacks {name}")
        hf_config = _hf_config(raw, is_mla)
        head_dim = raw.get("head_dim")
        if head_dim is None and isinstance(hidden, int) and isinstance(heads, int):
            head_dim = hidden // heads
        return cls(
            architecture=architecture,
            attention="mla" if is_mla else "mha",
            hidden_size=hidden,
            intermediate_size=raw.get("intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            hidden_act=raw.get("hidden_act", "silu"),
            vocab_size=vocab,
            draft_vocab_size=raw.get("draft_vocab_size") or vocab,
            target_hidden_size=raw.get("target_hidden_size", eagle.get("target_hidden_size")),
            aux_layer_ids=None if ids is None else tuple(sorted(_index(i) for i in ids)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            declares_eagle3=declares,
            q_lora_rank=raw.get("q_lora_rank") if is_mla else None,
            kv_lora_rank=raw.get("kv_lora_rank") if is_mla else None,
            qk_nope_head_dim=raw.get("qk_nope_head_dim") if is_mla else None,
            qk_rope_head_dim=raw.get("qk_rope_head_dim") if is_mla else None,
            v_head_dim=raw.get("v_head_dim") if is_mla else None,
            # DeepSeek MLA RoPE is the interleaved (GPT-J) pairing unless a config says otherwise.
            rope_interleave=bool(raw.get("rope_interleave", True)),
            rope_parameters=raw.get("rope_parameters"),
            max_position_embeddings=raw.get("max_position_embeddings"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            dtype=raw.get("dtype", raw.get("torch_dtype")),
            unshifted=bool(eagle.get("unshifted", False)),
            bootstrap_hidden=eagle.get("bootstrap_hidden"),
            kv_sharing_target_layers=eagle.get("kv_sharing_target_layers"),
            hf_config=hf_config,
            **flags,
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` object (the SGLang / SpecForge layout: EAGLE3 keys in ``eagle_config``, the 3.1
        flags there and at the top level); :meth:`from_dict` reads it back to an equal config."""
        eagle: dict[str, Any] = {
            "eagle_aux_hidden_state_layer_ids": None if self.aux_layer_ids is None else list(self.aux_layer_ids),
            "use_aux_hidden_state": True,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
        }
        if eagle["eagle_aux_hidden_state_layer_ids"] is None:
            del eagle["eagle_aux_hidden_state_layer_ids"]
        for name in ("norm_before_residual", "norm_before_fc"):
            if getattr(self, name):
                eagle[name] = True
        if self.unshifted:
            eagle["unshifted"] = True
        for name in ("bootstrap_hidden", "kv_sharing_target_layers"):
            if getattr(self, name) is not None:
                eagle[name] = getattr(self, name)
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "deepseek_v3" if self.attention == "mla" else "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "eagle_config": eagle,
            # Also at the top level: vLLM reads the 3.1 flags there only (and published 3.1 drafts put them there).
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
        }
        optional = {
            "target_hidden_size": self.target_hidden_size,
            "rope_parameters": self.rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": self.dtype,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        if self.attention == "mla":
            out.update(q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                       qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                       v_head_dim=self.v_head_dim, rope_interleave=self.rope_interleave)
        else:
            out.update(head_dim=self.head_dim, mlp_bias=self.mlp_bias)
        return out

    # ----- derived -----
    @property
    def num_aux_layers(self) -> int:
        return 3 if self.aux_layer_ids is None else len(self.aux_layer_ids)

    def resolve_aux_layer_ids(self, target_num_layers: int) -> tuple[int, ...]:
        """The target layers to capture, checked against the target's depth (:func:`resolve_aux_layer_ids`)."""
        return resolve_aux_layer_ids(self.aux_layer_ids, target_num_layers)


def resolve_aux_layer_ids(aux_layer_ids: tuple[int, ...] | None, target_num_layers: int) -> tuple[int, ...]:
    """The target layers a draft captures (capture-before, ascending): the given ids, checked against the
    target's depth, or EAGLE3's default ``(2, L // 2, L - 3)`` when none are given.

    Id ``L`` (the last layer's output) is refused: transformers' ``hidden_states[L]`` is post-norm
    while vLLM reads it as pre-norm, so a draft trained on either cannot be served unambiguously.
    Serving and training both apply this rule, so a trained draft reads what it was trained on.
    """
    if aux_layer_ids is None:
        ids = default_aux_layer_ids(target_num_layers)
        if len(set(ids)) != len(ids) or min(ids) < 0 or list(ids) != sorted(ids):
            raise ValueError(
                f"the target has {target_num_layers} layers, so EAGLE3's default aux ids "
                f"(2, L//2, L-3) = {ids} collide or run backwards; set "
                "eagle_config.eagle_aux_hidden_state_layer_ids in the draft config"
            )
        return tuple(ids)
    bad = [i for i in aux_layer_ids if i >= target_num_layers]
    if bad:
        raise ValueError(
            f"draft aux layer ids {list(aux_layer_ids)} name layers {bad} but the target has "
            f"{target_num_layers} layers; ids are capture-before (id i = input of layer i), each within "
            f"0..{target_num_layers - 1}"
        )
    return tuple(aux_layer_ids)


def _architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    known = MHA_ARCHITECTURES + MLA_ARCHITECTURES
    for arch in archs:
        if arch in known:
            return arch
    if "Eagle3Speculator" in archs or raw.get("speculators_model_type"):
        raise ValueError(
            "draft config is in the `speculators` format (Eagle3Speculator), which is not supported; "
            "use a draft saved in the EAGLE / SGLang / vLLM layout"
        )
    if not archs and raw.get("model_type") == "llama":
        # Some reference drafts omit architectures; the Llama layout is the only one that does.
        return "LlamaForCausalLM"
    raise ValueError(f"draft config architectures {list(archs)!r} is not an EAGLE3 draft; supported: {list(known)}")


def _flag(raw: Mapping[str, Any], eagle: Mapping[str, Any], name: str) -> bool:
    top, nested = raw.get(name), eagle.get(name)
    for where, value in ((name, top), (f"eagle_config.{name}", nested)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"draft config: {where} must be true or false, got {value!r}")
    if top is not None and nested is not None and top != nested:
        raise ValueError(f"draft config: {name} is {top} but eagle_config.{name} is {nested}; keep one")
    return bool(top if top is not None else nested)


def _index(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"draft config: aux layer id {value!r} is not an integer")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"draft config: aux layer id {value!r} is not an integer") from None


def _hf_config(raw: Mapping[str, Any], is_mla: bool):
    """A transformers config, for its normalised ``rope_parameters`` (rope_theta / rope_scaling spellings)."""
    keep = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map", "eagle_config")}
    if is_mla:
        # MoE settings are irrelevant to the dense draft layer; dropping them avoids validating them.
        for key in ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group"):
            keep.pop(key, None)
        # DeepseekV3Config defaults q_lora_rank to 1536; an absent key means no q compression here.
        keep["q_lora_rank"] = raw.get("q_lora_rank")
    cls = DeepseekV3Config if is_mla else LlamaConfig
    try:
        return cls(**keep)
    except Exception as err:  # transformers' strict validators raise several error types
        detail = " ".join(str(err).split())
        raise ValueError(f"draft config is not a valid {cls.__name__}: {detail}") from None
