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
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import attrs
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm.auto import tqdm

from specdec.models.base import default_aux_layer_ids
from specdec.models.weights import checkpoint_parameters
from specdec.proposers.eagle3.config import Eagle3DraftConfig
from specdec.proposers.eagle3.head import Eagle3Head
from specdec.train.corpus import CorpusConfig, corpus_fingerprint, load_documents
from specdec.train.data import WindowBatches, spread_windows, tokenize_documents, windows
from specdec.train.schedule import adamw, cosine_lr, set_lr
from specdec.train.tokenizer import BOS_ID, EOS_ID, PAD_ID, load_tokenizer
from specdec.train.ttt import TTTContext
from specdec.train.vocab import DraftVocab, frequency_vocab

_MOE_TYPES = ("deepseek_v3", "kimi_k2", "minimax_m2", "minimax_m3_vl_text")


def _aux_ids(value):
    return None if value is None else tuple(int(i) for i in value)


@attrs.frozen
class DraftPreset:
    """An EAGLE3 draft architecture for a given target, and its training schedule.

    The draft's hidden size is the target's (it shares the target's embedding). MLA drafts take
    their latent shape and heads from the target (their KV must fit the target's MLA pool).
    """

    name: str
    attention: str = attrs.field(validator=attrs.validators.in_(("mha", "mla")))
    intermediate_size: int = attrs.field(validator=attrs.validators.ge(1))
    num_attention_heads: int | None = None  # MHA; None = the target's
    num_key_value_heads: int | None = None  # MHA; None = the target's
    head_dim: int | None = None  # MHA; None = the target's
    draft_vocab_size: int | None = None  # None: the target's whole vocabulary (no d2t)
    own_lm_head: bool = False  # False: the target's output rows of the draft vocabulary, frozen
    aux_layer_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_aux_ids)
    eagle31: bool = False  # EAGLE3.1: fc_norm (per-chunk RMSNorm before fc) and norm_output
    unshifted: bool = False
    kv_sharing: bool = False  # unshifted only: attend over a target layer's KV at prompt positions
    kv_sharing_layer: int | None = None  # None: the last target layer whose KV layout matches
    # Self-distillation: windows of text the target itself generates (greedy, from corpus prompts of
    # prompt_len tokens), a generated_fraction of every batch. Serving drafts the target's own text,
    # which corpus windows alone do not show the draft.
    generated_windows: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    generated_fraction: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])
    prompt_len: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    generation_batch: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    ttt_steps: int = attrs.field(default=5, validator=attrs.validators.ge(1))
    step_decay: float = attrs.field(default=0.8, validator=attrs.validators.gt(0.0))
    seq_len: int = attrs.field(default=512, validator=attrs.validators.ge(8))
    batch_size: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    steps: int = attrs.field(default=600, validator=attrs.validators.ge(1))
    quick_steps: int = attrs.field(default=60, validator=attrs.validators.ge(1))
    lr: float = attrs.field(default=2e-3, validator=attrs.validators.gt(0.0))
    min_lr_ratio: float = 0.1
    warmup_steps: int = attrs.field(default=30, validator=attrs.validators.ge(0))
    weight_decay: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    grad_clip: float = attrs.field(default=1.0, validator=attrs.validators.gt(0.0))
    description: str = ""

    def __attrs_post_init__(self) -> None:
        if self.kv_sharing and not self.unshifted:
            raise ValueError(f"draft preset {self.name!r}: kv_sharing needs unshifted=True (shifted positions "
                             "do not line up with the target's KV)")
        if self.kv_sharing and self.attention != "mha":
            raise ValueError(f"draft preset {self.name!r}: KV-sharing training supports MHA drafts only so far")
        if self.attention == "mla" and any(v is not None for v in
                                           (self.num_attention_heads, self.num_key_value_heads, self.head_dim)):
            raise ValueError(f"draft preset {self.name!r}: an MLA draft takes its heads from the target; "
                             "drop num_attention_heads / num_key_value_heads / head_dim")
        if self.kv_sharing_layer is not None and not self.kv_sharing:
            raise ValueError(f"draft preset {self.name!r}: kv_sharing_layer given without kv_sharing=True")
        if self.quick_steps > self.steps:
            raise ValueError(f"draft preset {self.name!r}: quick_steps ({self.quick_steps}) exceeds steps ({self.steps})")
        if self.prompt_len is not None and self.prompt_len >= self.seq_len:
            raise ValueError(f"draft preset {self.name!r}: prompt_len ({self.prompt_len}) must be below seq_len "
                             f"({self.seq_len}) so generated windows have a continuation")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def generation_prompt_len(self) -> int:
        """Corpus tokens each generated window starts from (default: an eighth of the window)."""
        return self.prompt_len if self.prompt_len is not None else max(1, self.seq_len // 8)

    @property
    def generated_per_batch(self) -> int:
        """How many windows of each batch are target-generated text."""
        if self.generated_windows == 0:
            return 0
        return max(1, min(self.batch_size, round(self.batch_size * self.generated_fraction)))


# ----------------------------------------------------------------------------- target


class HFTarget:
    """A frozen transformers target: aux hidden states, logits and (optionally) one layer's K/V."""

    def __init__(self, folder: str | Path, autocast: bool = True, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        from specdec.models.loader import read_config_json

        self.folder = Path(folder)
        raw = read_config_json(self.folder)
        kwargs = {"experts_implementation": "grouped_mm"} if raw.get("model_type") in _MOE_TYPES else {}
        if dtype == torch.float64 and kwargs:
            kwargs["experts_implementation"] = "eager"  # the grouped-mm expert kernel has no float64
        # fp32 copy of the (bf16) checkpoint by default; the forward runs under bf16 autocast like training.
        self.model = AutoModelForCausalLM.from_pretrained(str(self.folder), local_files_only=True, dtype=dtype,
                                                          **kwargs)
        self.model.requires_grad_(False)
        self.model.eval()
        self.config = self.model.config
        self.autocast = autocast
        self.num_layers = self.config.num_hidden_layers
        self.hidden_size = self.config.hidden_size
        self.vocab_size = self.config.vocab_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    def output_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, aux_layer_ids, kv_layer: int | None = None):
        """``(aux [B, S, n*H], logits [B, S, V] fp32, (k, v) [B, kv, S, D] or None)`` for windows ``[B, S]``."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(input_ids=input_ids, output_hidden_states=True, use_cache=kv_layer is not None)
        work = torch.float64 if out.logits.dtype == torch.float64 else torch.float32
        aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1).to(work)
        kv = None
        if kv_layer is not None:
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            layer = cache.layers[kv_layer]
            kv = (layer.keys.to(work), layer.values.to(work))
        return aux, out.logits.to(work), kv

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, total_len: int, batch_size: int, progress: bool = False,
                 desc: str = "generate") -> torch.Tensor:
        """Greedy continuations of ``prompts [N, P]`` to ``total_len`` tokens each (never stopping early)."""
        new = total_len - prompts.shape[1]
        if new <= 0:
            raise ValueError(f"total_len ({total_len}) must exceed the prompt length ({prompts.shape[1]})")
        out = []
        bar = tqdm(total=prompts.shape[0], desc=desc, disable=not progress, dynamic_ncols=True)
        for start in range(0, prompts.shape[0], batch_size):
            chunk = prompts[start : start + batch_size]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                # eos_token_id=None with min_new_tokens: every window is full length, EOS included as text.
                seqs = self.model.generate(chunk, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                           eos_token_id=None, pad_token_id=PAD_ID,
                                           attention_mask=torch.ones_like(chunk))
            out.append(seqs[:, :total_len])
            bar.update(chunk.shape[0])
        bar.close()
        return torch.cat(out)

    def layer_kv_layout(self) -> list[tuple[int, int] | None]:
        """``(kv_heads, head_dim)`` of each layer's cached K/V (None where it is not plain MHA/GQA)."""
        config = self.config
        if getattr(config, "kv_lora_rank", None):
            return [None] * self.num_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return [(kv_heads, head_dim)] * self.num_layers


# ----------------------------------------------------------------------------- draft construction


def resolve_aux_layer_ids(preset: DraftPreset, target: HFTarget) -> tuple[int, ...]:
    """The preset's ids, or EAGLE3's default ``(2, L//2, L-3)`` when it gives none and they are distinct."""
    if preset.aux_layer_ids is not None:
        ids = preset.aux_layer_ids
    else:
        ids = default_aux_layer_ids(target.num_layers)
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(
                f"the target has {target.num_layers} layers, so the default aux ids {ids} collide; give the draft "
                "preset explicit aux_layer_ids (ascending, each < num_layers)"
            )
    if list(ids) != sorted(set(ids)) or min(ids) < 0 or max(ids) >= target.num_layers:
        raise ValueError(
            f"aux_layer_ids {list(ids)} must be distinct, ascending and within 0..{target.num_layers - 1} "
            "(capture-before: id i is the input of target layer i)"
        )
    return tuple(ids)


def resolve_kv_sharing_layer(preset: DraftPreset, target: HFTarget, kv_heads: int, head_dim: int) -> int | None:
    if not preset.kv_sharing:
        return None
    layouts = target.layer_kv_layout()
    if preset.kv_sharing_layer is not None:
        layer = preset.kv_sharing_layer
        if not 0 <= layer < target.num_layers:
            raise ValueError(f"kv_sharing_layer {layer} is outside the target's layers 0..{target.num_layers - 1}")
        if layouts[layer] != (kv_heads, head_dim):
            raise ValueError(
                f"target layer {layer}'s KV layout {layouts[layer]} differs from the draft's ({kv_heads}, {head_dim}) "
                "(kv_heads, head_dim); pick a matching layer or change the draft's heads"
            )
        return layer
    matching = [i for i, layout in enumerate(layouts) if layout == (kv_heads, head_dim)]
    if not matching:
        raise ValueError(
            f"no target layer has the draft's KV layout (kv_heads {kv_heads}, head_dim {head_dim}); set the draft "
            "preset's num_key_value_heads / head_dim to the target's"
        )
    return matching[-1]


def draft_config_dict(preset: DraftPreset, target: HFTarget, vocab: DraftVocab, aux_ids: tuple[int, ...],
                      kv_layer: int | None) -> dict:
    """The complete ``config.json`` of the draft (EAGLE3 keys in ``eagle_config``)."""
    tc = target.config
    rope = dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    rope.pop("partial_rotary_factor", None)  # the draft rotates whole heads
    eagle = {
        "eagle_aux_hidden_state_layer_ids": list(aux_ids),
        "use_aux_hidden_state": True,
        "fc_norm": preset.eagle31,
        "norm_output": preset.eagle31,
    }
    if preset.unshifted:
        # Read by the unshifted proposer: draft token p sits at position p with the target's hidden
        # state of p - 1; position 0 gets a zero bootstrap hidden state (as in training).
        eagle["unshifted"] = True
        eagle["bootstrap_hidden"] = "zeros"
        if kv_layer is not None:
            eagle["kv_sharing_target_layers"] = {"0": kv_layer}
    config = {
        "hidden_size": target.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": 1,
        "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
        "hidden_act": "silu",
        "vocab_size": target.vocab_size,
        "draft_vocab_size": vocab.size,
        "target_hidden_size": target.hidden_size,
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 8192)),
        "rope_parameters": rope,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": "bfloat16",
        "eagle_config": eagle,
    }
    if preset.attention == "mha":
        heads = preset.num_attention_heads or tc.num_attention_heads
        config.update(
            architectures=["LlamaForCausalLMEagle3"],
            model_type="llama",
            num_attention_heads=heads,
            num_key_value_heads=preset.num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=preset.head_dim or getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            mlp_bias=False,
        )
    else:
        if not getattr(tc, "kv_lora_rank", None):
            raise ValueError(f"an MLA draft needs an MLA target; {target.folder} ({tc.model_type}) has no kv_lora_rank")
        config.update(
            architectures=["Eagle3DeepseekV2ForCausalLM"],
            model_type="deepseek_v3",
            num_attention_heads=tc.num_attention_heads,
            num_key_value_heads=tc.num_attention_heads,
            q_lora_rank=tc.q_lora_rank,
            kv_lora_rank=tc.kv_lora_rank,
            qk_nope_head_dim=tc.qk_nope_head_dim,
            qk_rope_head_dim=tc.qk_rope_head_dim,
            v_head_dim=tc.v_head_dim,
            rope_interleave=bool(getattr(tc, "rope_interleave", True)),
        )
    return config


def build_draft(config: dict, aux_ids: tuple[int, ...], target: HFTarget, vocab: DraftVocab,
                own_lm_head: bool, seed: int) -> Eagle3Head:
    """The serving draft module for ``config``, freshly initialised (fp32) and wired to the target."""
    parsed = Eagle3DraftConfig.from_dict(config)
    if parsed.attention == "mla":
        from specdec.proposers.eagle3.mla_model import Eagle3MLADraft as cls
    else:
        from specdec.proposers.eagle3.model import Eagle3LlamaDraft as cls
    torch.manual_seed(seed)
    draft = cls(parsed, aux_layer_ids=aux_ids, target_hidden_size=target.hidden_size, own_embedding=False,
                own_lm_head=own_lm_head)
    # Checkpoint order and shapes (packed projections as their parts), so a seed draws what it always drew.
    for name, param in checkpoint_parameters(draft):
        with torch.no_grad():
            if param.ndim >= 2:
                param.normal_(0.0, 0.02)
            else:
                param.fill_(1.0)  # RMSNorm gains
    with torch.no_grad():
        draft.d2t.copy_(vocab.d2t)
        draft.t2d.copy_(vocab.t2d)
        if own_lm_head:
            # Start from the target's own rows: the fused hidden begins near the target's space.
            draft.lm_head.weight.copy_(target.output_weight()[vocab.target_ids])
    # The target's embedding and (without an own lm_head) output rows, frozen and not saved.
    draft.share_target(SimpleNamespace(embed=target.embed), None if own_lm_head else target.output_weight())
    # Bind the attention to a (never materialised) pool name: TTTContext ignores pools.
    draft.kv_pools("draft", 16, torch.float32)
    draft.train()
    return draft


# ----------------------------------------------------------------------------- the TTT forward


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


def _random_splits(generator: torch.Generator, batch: int, seq: int, enabled: bool) -> torch.Tensor | None:
    """Per-window prompt lengths for KV-sharing training: uniform over ``[0, seq/2]`` (0 = no sharing)."""
    if not enabled:
        return None
    return torch.randint(0, seq // 2 + 1, (batch,), generator=generator)


# ----------------------------------------------------------------------------- training


def _preset_or_raise(value) -> DraftPreset:
    if isinstance(value, str):
        return get_draft_preset(value)
    return value


@attrs.frozen
class DraftTrainConfig:
    """One draft training run against a trained target folder."""

    preset: DraftPreset = attrs.field(converter=_preset_or_raise)
    target_dir: str = attrs.field(converter=str)
    output_dir: str = attrs.field(converter=str)
    steps: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    quick: bool = False
    seed: int = 0
    eval_every: int = attrs.field(default=100, validator=attrs.validators.ge(1))
    eval_windows: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    threads: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    autocast: bool = True
    progress: bool = True
    corpus: CorpusConfig = attrs.field(factory=CorpusConfig)

    def __attrs_post_init__(self) -> None:
        if self.steps is not None and self.quick:
            raise ValueError("give either steps or quick, not both: quick means the preset's quick_steps")

    @property
    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        return self.preset.quick_steps if self.quick else self.preset.steps


@attrs.frozen
class DraftTrainResult:
    output_dir: Path
    steps: int
    train_losses: list[float]
    val_accuracy: list[tuple[int, list[float]]]  # (step, per-TTT-step top-1 agreement on corpus windows)
    # (step, greedy acceptance per position at k=3, replayed on the target's own greedy text)
    val_acceptance: list[tuple[int, list[float]]]
    tokens_per_second: float
    num_parameters: int  # trainable (saved) parameters


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


def train_draft(config: DraftTrainConfig) -> DraftTrainResult:
    """Train the draft preset against ``config.target_dir`` and save it to ``config.output_dir``."""
    preset = config.preset
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    target = HFTarget(config.target_dir, autocast=config.autocast)
    tokenizer = load_tokenizer(config.target_dir)
    if len(tokenizer) != target.vocab_size:
        raise ValueError(f"the target's tokenizer has {len(tokenizer)} tokens but its config says vocab_size "
                         f"{target.vocab_size}; retrain the target with specdec.train")
    train_docs = load_documents("train", config.corpus)
    val_docs = load_documents("validation", config.corpus)
    train_stream = tokenize_documents(tokenizer, train_docs)
    val_windows = spread_windows(windows(tokenize_documents(tokenizer, val_docs), preset.seq_len), config.eval_windows)

    vocab = frequency_vocab(train_stream, target.vocab_size, preset.draft_vocab_size, always=(EOS_ID,))
    aux_ids = resolve_aux_layer_ids(preset, target)
    draft_cfg = draft_config_dict(preset, target, vocab, aux_ids, kv_layer=None)
    draft = build_draft(draft_cfg, aux_ids, target, vocab, preset.own_lm_head, config.seed)
    attn = draft.midlayer.self_attn
    kv_layer = None
    if preset.kv_sharing:
        kv_layer = resolve_kv_sharing_layer(preset, target, attn.num_kv_heads, attn.head_dim)
        draft_cfg = draft_config_dict(preset, target, vocab, aux_ids, kv_layer=kv_layer)

    # The target's own greedy text: validation windows always (the acceptance estimate), training
    # windows when the preset asks for them.
    val_prompts = val_windows[:, : preset.generation_prompt_len]
    val_generated = target.generate(val_prompts, preset.seq_len, preset.generation_batch, config.progress,
                                    desc="generate val")
    n_gen = preset.generated_per_batch
    corpus_batches = iter(WindowBatches(train_stream, preset.seq_len - 1, preset.batch_size - n_gen,
                                        seed=config.seed)) if n_gen < preset.batch_size else None
    generated_batches = None
    if n_gen:
        pool = windows(train_stream, preset.seq_len)
        pick = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(config.seed + 2))
        # --quick scales generation down with the steps.
        count = max(n_gen, preset.generated_windows // 10) if config.quick else preset.generated_windows
        prompts = pool[pick[:count], : preset.generation_prompt_len]
        generated = target.generate(prompts, preset.seq_len, preset.generation_batch, config.progress,
                                    desc="generate train")
        generated_batches = iter(WindowBatches.from_windows(generated, n_gen, seed=config.seed + 3))

    def next_batch() -> torch.Tensor:
        parts = [next(it) for it in (generated_batches, corpus_batches) if it is not None]
        return torch.cat(parts)

    split_gen = torch.Generator().manual_seed(config.seed + 1)
    optimizer = adamw(draft, preset.lr, preset.weight_decay)
    total = config.total_steps
    train_losses: list[float] = []
    val_accuracy: list[tuple[int, list[float]]] = []
    val_acceptance: list[tuple[int, list[float]]] = []
    bar = tqdm(total=total, desc=f"draft {preset.name}", disable=not config.progress, dynamic_ncols=True)
    start = time.perf_counter()
    smoothed = None
    for step in range(total):
        set_lr(optimizer, cosine_lr(step, total=total, peak=preset.lr, warmup=preset.warmup_steps,
                                    min_ratio=preset.min_lr_ratio))
        batch = next_batch()
        split = _random_splits(split_gen, batch.shape[0], batch.shape[1], kv_layer is not None)
        out = ttt_forward(draft, target, batch, preset, vocab, kv_layer, split, config.autocast)
        if not torch.isfinite(out.loss):
            raise FloatingPointError(f"{preset.name}: draft loss became {float(out.loss)} at step {step}; lower the lr")
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad], preset.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(out.loss.detach())
        train_losses.append(value)
        smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
        if (step + 1) % config.eval_every == 0 or step + 1 == total:
            corpus_eval = evaluate_draft(draft, target, val_windows, preset, vocab, kv_layer, config.autocast)
            own_eval = evaluate_draft(draft, target, val_generated, preset, vocab, kv_layer, config.autocast,
                                      prompt_len=preset.generation_prompt_len)
            val_accuracy.append((step + 1, corpus_eval.agreement))
            val_acceptance.append((step + 1, own_eval.acceptance))
        elapsed = time.perf_counter() - start
        acc = [c / max(s, 1) for c, s in zip(out.step_correct, out.step_scored)]
        postfix = {"loss": f"{smoothed:.3f}", "acc": "/".join(f"{a:.2f}" for a in acc[:4]),
                   "tok/s": f"{(step + 1) * preset.tokens_per_step / elapsed:.0f}"}
        if val_acceptance:
            postfix["accept"] = "/".join(f"{a:.2f}" for a in val_acceptance[-1][1][:3])
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - start

    trainable = sum(p.numel() for p in draft.parameters())
    metadata = {
        "preset": attrs.asdict(preset),
        "target": str(Path(config.target_dir).name),
        "steps": total,
        "seed": config.seed,
        "threads": torch.get_num_threads(),
        "autocast_bf16": config.autocast,
        "aux_layer_ids": list(aux_ids),
        "kv_sharing_target_layer": kv_layer,
        "draft_vocab_size": vocab.size,
        "draft_vocab_coverage": _coverage(train_stream, vocab),
        "final_train_loss": sum(train_losses[-20:]) / len(train_losses[-20:]),
        "generated_windows": 0 if generated_batches is None else int(generated.shape[0]),
        "val_top1_agreement_per_step": val_accuracy,
        "val_greedy_acceptance_per_position": val_acceptance,
        "val_mean_acceptance_length_k3": 1.0 + sum(val_acceptance[-1][1]) if val_acceptance else None,
        "num_parameters": trainable,
        "corpus_fingerprint": corpus_fingerprint(train_docs),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    save_draft(draft, draft_cfg, vocab, config.output_dir, metadata)
    return DraftTrainResult(Path(config.output_dir), total, train_losses, val_accuracy, val_acceptance,
                            total * preset.tokens_per_step / elapsed, trainable)


def _coverage(stream: torch.Tensor, vocab: DraftVocab) -> float:
    """Fraction of corpus tokens the draft vocabulary can propose."""
    return round(float(vocab.t2d[stream].float().mean()), 4)


def save_draft(draft: Eagle3Head, config: dict, vocab: DraftVocab, folder: str | Path, metadata: dict | None = None,
               dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the draft in the ``layers.0.*`` layout (bf16) with ``d2t``/``t2d`` when the vocabulary is reduced."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, param in checkpoint_parameters(draft):
        key = "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name
        tensors[key] = param.detach().to(dtype).contiguous()
    if not vocab.is_full:
        tensors["d2t"] = vocab.d2t.contiguous()
        tensors["t2d"] = vocab.t2d.contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = dict(config, dtype=str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if metadata is not None:
        (folder / "training.json").write_text(json.dumps(_jsonable(metadata), indent=2) + "\n")
    return folder


def _jsonable(value):
    if isinstance(value, dict) or type(value).__name__ == "mappingproxy":
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


# ----------------------------------------------------------------------------- presets

DRAFT_PRESETS: dict[str, DraftPreset] = {}


def _register(preset: DraftPreset) -> DraftPreset:
    DRAFT_PRESETS[preset.name] = preset
    return preset


def get_draft_preset(name: str) -> DraftPreset:
    if name not in DRAFT_PRESETS:
        raise ValueError(f"unknown draft preset {name!r}; choose one of {sorted(DRAFT_PRESETS)}")
    return DRAFT_PRESETS[name]


_register(DraftPreset(
    name="minimax-m3-tiny-eagle3", attention="mha", intermediate_size=512, draft_vocab_size=3072,
    aux_layer_ids=(1, 3, 5),
    # Shorter windows, more of them, mostly the target's own greedy text from 64-token prompts: what
    # the benchmarks' requests ask the draft to predict.
    seq_len=256, steps=3000, quick_steps=60, prompt_len=64,
    generated_windows=2048, generated_fraction=0.75,
    description="EAGLE3 head for minimax-m3-tiny: GQA layer, reduced vocabulary (d2t), target's lm_head rows",
))
_register(DraftPreset(
    name="kimi-k2-tiny-eagle3.1-mla", attention="mla", intermediate_size=384, draft_vocab_size=3072, eagle31=True,
    aux_layer_ids=(1, 2, 3),
    steps=160, quick_steps=16,
    generated_windows=512,
    description="EAGLE3.1 MLA head for kimi-k2-tiny (fc_norm + norm_output), lives in the target's MLA pool",
))
_register(DraftPreset(
    name="kimi-k2-tiny-eagle3", attention="mha", intermediate_size=384, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, draft_vocab_size=1024, own_lm_head=True, aux_layer_ids=(1, 2, 3),
    steps=160, quick_steps=16,
    generated_windows=512,
    description="MHA EAGLE3 head for kimi-k2-tiny with its own 1024-token lm_head (needs its own KV pool)",
))
_register(DraftPreset(
    name="llama-tiny-eagle3", attention="mha", intermediate_size=384, aux_layer_ids=(1, 2, 3),
    steps=400, quick_steps=40,
    generated_windows=512,
    description="EAGLE3 head for llama-tiny over the whole vocabulary (no d2t)",
))
_register(DraftPreset(
    name="llama-tiny-eagle3-unshifted", attention="mha", intermediate_size=384, aux_layer_ids=(1, 2, 3),
    unshifted=True, kv_sharing=True,
    steps=400, quick_steps=40,
    generated_windows=512,
    description="Unshifted EAGLE3 head for llama-tiny that reads the last target layer's KV at prompt positions",
))
for _name, _kw in (
    ("test-eagle3", dict(attention="mha", draft_vocab_size=200, own_lm_head=True)),
    ("test-eagle3.1-mla", dict(attention="mla", eagle31=True, draft_vocab_size=300)),
    ("test-eagle3-unshifted", dict(attention="mha", unshifted=True, kv_sharing=True)),
):
    _register(DraftPreset(name=_name, intermediate_size=64, aux_layer_ids=(0, 1), ttt_steps=3, seq_len=32,
                          batch_size=4, steps=30, quick_steps=10, lr=5e-3, warmup_steps=3, description="test-sized",
                          **_kw))


def measure_draft_throughput(draft_preset: DraftPreset | str, target_preset: str, steps: int = 3,
                             threads: int | None = None, vocab_size: int = 4096) -> dict:
    """Draft training tokens/s against a randomly initialised target of ``target_preset`` (same cost as a trained one)."""
    import tempfile

    from specdec.train.presets import get_preset

    preset = _preset_or_raise(draft_preset)
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = get_preset(target_preset).build_model(vocab_size)
        model.to(torch.bfloat16).save_pretrained(tmp)
        target = HFTarget(tmp)
    generator = torch.Generator().manual_seed(0)
    stream = torch.randint(3, vocab_size, (preset.tokens_per_step * 4,), generator=generator)
    vocab = frequency_vocab(stream, vocab_size, preset.draft_vocab_size, always=(EOS_ID,))
    aux_ids = resolve_aux_layer_ids(preset, target)
    draft = build_draft(draft_config_dict(preset, target, vocab, aux_ids, None), aux_ids, target, vocab,
                        preset.own_lm_head, seed=0)
    attn = draft.midlayer.self_attn
    kv_layer = resolve_kv_sharing_layer(preset, target, attn.num_kv_heads, attn.head_dim) if preset.kv_sharing else None
    optimizer = adamw(draft, preset.lr, preset.weight_decay)
    times, target_times = [], []
    for i in range(steps + 1):
        batch = torch.randint(3, vocab_size, (preset.batch_size, preset.seq_len), generator=generator)
        split = _random_splits(generator, preset.batch_size, preset.seq_len, kv_layer is not None)
        t0 = time.perf_counter()
        target.run(batch, aux_ids, kv_layer)
        t1 = time.perf_counter()
        ttt_forward(draft, target, batch, preset, vocab, kv_layer, split, autocast=True).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i > 0:
            times.append(time.perf_counter() - t1)  # includes the target forward ttt_forward runs
            target_times.append(t1 - t0)
    # The fastest step estimates the uncontended cost (the 2 CPU cores are shared); the median shows contention.
    step_s = min(times)
    median_s = sorted(times)[len(times) // 2]
    return {
        "preset": preset.name,
        "target": target_preset,
        "num_parameters": sum(p.numel() for p in draft.parameters()),
        "threads": torch.get_num_threads(),
        "ttt_steps": preset.ttt_steps,
        "tokens_per_step": preset.tokens_per_step,
        "best_step_s": round(step_s, 3),
        "median_step_s": round(median_s, 3),
        "target_forward_s": round(sorted(target_times)[len(target_times) // 2], 3),
        "tokens_per_second": round(preset.tokens_per_step / step_s, 1),
        "full_run_minutes": round(preset.steps * step_s / 60, 1),
        "quick_run_minutes": round(preset.quick_steps * step_s / 60, 1),
    }
