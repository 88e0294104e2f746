"""MiniMax-M2 (``minimax_m2``) over the paged KV cache.

GQA attention with one RMSNorm over the *whole* q and k projections (not per head), partial RoPE
(``rope_parameters["partial_rotary_factor"]``; old hub configs say ``rotary_dim``), and a
sigmoid-routed MoE with a score-correction bias and no shared expert in every layer.

The MoE pieces (router, fused experts, per-expert checkpoint loading) are shared with MiniMax-M3,
which imports them from here. Experts are stored fused like transformers 5.x keeps them
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``); checkpoints written per
expert (``block_sparse_moe.experts.N.w1/w2/w3``, what ``save_pretrained`` and the hub write) are
copied into slices of those tensors while streaming, so no second copy of the weights is built.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from specdec.models.base import ForwardContext
from specdec.models.decoder import DecoderOnlyLM, PreNormDecoderLayer, bound_pool
from specdec.models.decoder import aux_capture_counts  # noqa: F401  (re-exported: its first home was here)
from specdec.models.layers import RMSNorm, RotaryEmbedding, compute_dtype
from specdec.models.loader import CheckpointError
from specdec.models.weights import load_named_weights


# ----------------------------------------------------------------------------------------------
# shared helpers (also used by minimax_m3)
# ----------------------------------------------------------------------------------------------
def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim_of(config) -> int:
    """Rotated channels per head, as transformers derives them: ``head_dim * partial_rotary_factor``."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    dim = int(head_dim_of(config) * factor)
    if not 0 < dim <= head_dim_of(config) or dim % 2:
        raise ValueError(
            f"partial_rotary_factor {factor} gives {dim} rotary channels for head_dim {head_dim_of(config)}; "
            "it must give an even number between 2 and head_dim"
        )
    return dim


def check_gqa(num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )


def is_mtp_tensor(name: str) -> bool:
    """MiniMax's multi-token-prediction modules (``mtp.*``): the target does not run them."""
    return re.search(r"(^|\.)mtp\.", name) is not None


def sigmoid_topk_routing(
    router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax routing: experts chosen by ``sigmoid(logit) + bias``, weighted by the normalised sigmoid.

    The bias only steers the choice (load balancing); the weights come from the raw sigmoid scores.
    Computed in at least float32 like the reference. Returns ``(weights [T, k], experts [T, k])``.
    """
    scores = torch.sigmoid(router_logits.to(compute_dtype(router_logits.dtype)))
    chosen = torch.topk(scores + correction_bias.to(scores.dtype), top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    return weights / weights.sum(dim=-1, keepdim=True), chosen


class FusedExperts(nn.Module):
    """``E`` gated experts as two 3-D tensors; ``activation`` maps ``[n, 2I]`` gate|up to ``[n, I]``.

    Tokens are sorted by expert so each expert runs one matmul over all its tokens (a loop over
    experts, never over tokens); results are put back in token order and summed over the k slots.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.activation = activation

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[token]
        out_rows = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                seg = self.activation(F.linear(rows[start : start + n], self.gate_up_proj[e]))
                out_rows[start : start + n] = F.linear(seg, self.down_proj[e])
                start += n
        # Back to (token, slot) order, then a fixed-order sum over the k slots: deterministic, unlike
        # index_add_, and cheaper on CPU. Routing weights keep the router's (>= float32) precision.
        unsorted = torch.empty_like(out_rows)
        unsorted[order] = out_rows
        weighted = unsorted.view(num_tokens, top_k, x.shape[-1]) * weights[..., None]
        return weighted.sum(dim=1).to(x.dtype)


# ----- streaming loader for split checkpoint tensors -----
@attrs.frozen
class SliceTarget:
    """A checkpoint tensor that fills ``param[index]``; ``total`` pieces complete the parameter."""

    param: str
    index: tuple
    total: int



def load_weights_with_slices(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | SliceTarget | None],
) -> None:
    """Like :func:`load_named_weights`, but names mapped to a :class:`SliceTarget` are copied into a
    slice of a fused parameter (per-expert ``w1/w2/w3``, split ``gate_proj``/``up_proj``)."""
    params = dict(module.named_parameters())
    pieces: dict[str, set[tuple]] = {}
    totals: dict[str, int] = {}

    def whole_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            target = rename(name)
            if not isinstance(target, SliceTarget):
                yield name, tensor
                continue
            param = params.get(target.param)
            if param is None:
                raise CheckpointError(f"unexpected tensors in the checkpoint: {name}")
            dest = param.data[target.index]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}"
                )
            with torch.no_grad():
                dest.copy_(tensor)
            pieces.setdefault(target.param, set()).add(_index_key(target.index))
            totals[target.param] = target.total

    def plain_name(name: str) -> str | None:
        target = rename(name)
        return None if isinstance(target, SliceTarget) else target

    load_named_weights(module, whole_tensors(), rename=plain_name, optional=lambda n: n in pieces)
    partial = [f"{p} ({len(pieces[p])} of {totals[p]} pieces)" for p in pieces if len(pieces[p]) < totals[p]]
    if partial:
        raise CheckpointError(f"tensors missing from the checkpoint: per-expert/split parts of {', '.join(partial)}")


def _index_key(index: tuple) -> tuple:
    return tuple((i.start, i.stop) if isinstance(i, slice) else i for i in index)


_PER_EXPERT = re.compile(
    r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def expert_slice(name: str, num_experts: int, intermediate_size: int) -> SliceTarget | None:
    """Per-expert checkpoint name -> the slice of the fused ``mlp.experts`` tensors it fills."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    layer, expert, part = match.group(1), int(match.group(2)), _EXPERT_PART[match.group(3)]
    if not 0 <= expert < num_experts:
        raise CheckpointError(f"tensor {name!r} names expert {expert}, the model has {num_experts} experts")
    inter = intermediate_size
    if part == "down":
        return SliceTarget(f"{layer}.mlp.experts.down_proj", (expert,), num_experts)
    rows = slice(0, inter) if part == "gate" else slice(inter, 2 * inter)
    return SliceTarget(f"{layer}.mlp.experts.gate_up_proj", (expert, rows), 2 * num_experts)


# ----------------------------------------------------------------------------------------------
# MiniMax-M2
# ----------------------------------------------------------------------------------------------
class MiniMaxM2Attention(nn.Module):
    """GQA attention; q_norm / k_norm normalise the full projection width before the head split."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        check_gqa(self.num_heads, self.num_kv_heads)
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, eps=config.rms_norm_eps)
        self.pool: str | None = None  # bound by kv_pools()

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        pool = bound_pool(self.pool)
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x)).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x)).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = ctx.attend(pool, self.layer_idx, q, k, v, scale=self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MiniMaxM2SparseMoeBlock(nn.Module):
    """Sigmoid router with score-correction bias over fused experts; no shared expert."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        num_experts = config.num_local_experts
        if not 0 < self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in 1..num_local_experts ({num_experts})")
        act = getattr(config, "hidden_act", "silu")
        if act not in ACT2FN:
            raise ValueError(f"unknown hidden_act {act!r}; choose one of {sorted(ACT2FN)}")
        act_fn = ACT2FN[act]
        inter = config.intermediate_size

        def gated(gate_up: torch.Tensor) -> torch.Tensor:
            return act_fn(gate_up[..., :inter]) * gate_up[..., inter:]

        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, config.hidden_size, inter, gated)
        # A parameter (not a buffer) so that a checkpoint without it is reported as incomplete.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = sigmoid_topk_routing(self.gate(x), self.e_score_correction_bias, self.top_k)
        return self.experts(x, experts, weights)


class MiniMaxM2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = MiniMaxM2Attention(config, layer_idx)
        self.mlp = MiniMaxM2SparseMoeBlock(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MiniMaxM2Model(nn.Module):
    """Embeddings, decoder layers and the final norm (``model.*`` in the checkpoint)."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MiniMaxM2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, rotary_dim_of(config))


class MiniMaxM2ForCausalLM(DecoderOnlyLM):
    """``minimax_m2`` causal LM implementing :class:`specdec.models.CausalLM`."""

    def __init__(self, config):
        if config.model_type != "minimax_m2":
            raise ValueError(f"MiniMaxM2ForCausalLM serves model_type 'minimax_m2', got {config.model_type!r}")
        super().__init__(config, MiniMaxM2Model(config))
        self._num_experts = config.num_local_experts
        self._intermediate = config.intermediate_size

    # ----- weights -----
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights_with_slices(self, weights, self._checkpoint_name)

    def _checkpoint_name(self, name: str) -> str | SliceTarget | None:
        if is_mtp_tensor(name):
            return None
        name = self._common_checkpoint_name(name)
        if name is None:
            return None
        sliced = expert_slice(name, self._num_experts, self._intermediate)
        if sliced is not None:
            return sliced
        # Hub / save_pretrained spellings -> the module tree (transformers' own internal names).
        name = name.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.e_score_correction_bias")
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
        return name.replace(".block_sparse_moe.", ".mlp.")
