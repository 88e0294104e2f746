"""Mixture-of-experts pieces shared by DeepSeek-V3 / Kimi-K2, MiniMax-M2 and MiniMax-M3.

Routed experts are held stacked, as transformers 5.x keeps them in memory: ``gate_up_proj [E, 2I, H]``
(gate rows first) and ``down_proj [E, H, I]``. Checkpoints written per expert (transformers'
``save_pretrained`` and the hub: ``mlp.experts.N.{gate,up,down}_proj.weight``, MiniMax's
``block_sparse_moe.experts.N.{w1,w3,w2}.weight``) are copied into slices of those tensors while
streaming (:func:`expert_slice`), so loading never builds a second copy of the experts.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from specdec.backends import invariance
from specdec.backends.base import math_dtype
from specdec.distributed import parallel_state as ps
from specdec.models.layers import activation, compute_dtype, linear, onednn_prepack
from specdec.models.loader import CheckpointError
from specdec.models.parallel import PartsShard, split_spec
from specdec.models.weights import PIECE, SliceTarget, row_pieces


def check_top_k(top_k: int, num_experts: int) -> None:
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_local_experts ({num_experts})")


def gated_activation(hidden_act: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``act(gate) * up`` over ``[n, 2I]`` rows holding the gate half then the up half."""
    act = activation(hidden_act)

    def gated(gate_up: torch.Tensor) -> torch.Tensor:
        half = gate_up.shape[-1] // 2
        return act(gate_up[..., :half]) * gate_up[..., half:]

    return gated


def sigmoid_topk_routing(
    router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax routing: experts chosen by ``sigmoid(logit) + bias``, weighted by the normalised sigmoid.

    The bias only steers the choice (load balancing); the weights come from the raw sigmoid scores.
    Computed in at least float32 like the reference. Returns ``(weights [T, k], experts [T, k])``.
    """
    scores = invariance.sigmoid(router_logits.to(compute_dtype(router_logits.dtype)))
    chosen = torch.topk(scores + correction_bias.to(scores.dtype), top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    return weights / weights.sum(dim=-1, keepdim=True), chosen


class FusedExperts(nn.Module):
    """``E`` gated experts as two stacked tensors, ``top_k`` of them per token; ``activation`` maps
    ``[n, 2I]`` gate|up to ``[n, I]``.

    Two schedules, one result (up to matmul rounding): a small MoE (at most ``DENSE_MAX_WASTE`` times
    as many experts as each token routes to) over a batch that would route at most
    ``DENSE_MAX_ROWS_PER_EXPERT`` rows to an expert on average runs every expert on every token, a fixed
    handful of ops whatever the routing; otherwise (token, slot) pairs are sorted by expert and each
    expert runs one matmul over its tokens (a loop over experts, never over tokens), which computes
    only routed rows. The dense schedule does ``num_experts / top_k`` times the routed work but skips
    the loop's per-expert overhead, so decode, verify and short prompts take it; a real MoE (hundreds
    of experts) never does. Served (:meth:`prepack_weights`), it runs as two wide layers
    (:meth:`_dense`); where the routed schedule overtakes it, ``benchmarks/bench_moe.py`` shows (on the
    zoo's MoEs, bf16 on a 2-core EPYC: past 64 tokens for 4 experts, 128 for 8, both top-2).

    The batch-invariant mode picks the schedule from the model, not the batch (:meth:`_invariant_rows`).
    """

    DENSE_MAX_ROWS_PER_EXPERT = 32
    DENSE_MAX_WASTE = 8
    INVARIANT_DENSE_EXPERTS = 8

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
        *,
        top_k: int,
    ):
        super().__init__()
        tp = ps.current()
        check_top_k(top_k, num_experts)
        self.num_experts, self.top_k = num_experts, top_k
        # Tensor parallelism splits every expert's intermediate features; the ranks' outputs are summed.
        self.intermediate_size = local = tp.shard(intermediate_size, "the experts' intermediate_size")
        self.tp = tp
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local))
        self.activation = activation
        self.prepacked: tuple[torch.Tensor, torch.Tensor] | None = None  # see prepack_weights
        self.wide: tuple[tuple, tuple] | None = None  # the two wide layers of _dense, see prepack_weights
        rows, cols = split_spec(1), split_spec(2)
        self.tp_shards = {
            "gate_up_proj": PartsShard(1, ((intermediate_size, rows), (intermediate_size, rows))),
            "down_proj": cols,
            # One expert's gate, up [I, H] or down [H, I] tensor (per-expert checkpoints).
            "gate_up_proj" + PIECE: split_spec(0),
            "down_proj" + PIECE: split_spec(1),
        }

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` as ``[T, H]``, summed in at least float32.

        The result stays in that precision: callers add their shared experts or scaling and cast.
        Every schedule sums the k slots in a fixed order (deterministic, unlike index_add_, and far
        cheaper on CPU): the per-slot products' weighted sum, or the wide down GEMM's accumulation.
        """
        if invariance.enabled():
            out = self._weighted_sum(self._invariant_rows(x, experts), weights)
        elif not self.runs_dense(x.shape[0]):
            out = self._weighted_sum(self._routed_rows(x, experts), weights)
        elif self.wide is not None:
            out = self._dense(x, experts, weights)
        else:
            out = self._weighted_sum(self._every_expert(x, experts), weights)
        return ps.all_reduce(self.tp, out) if self.tp.size > 1 else out

    def _invariant_rows(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The batch-invariant mode's per-slot products: a MoE of at most ``INVARIANT_DENSE_EXPERTS``
        experts runs every expert on every token, others the routed schedule, either one over tokens in
        fixed blocks (each product then has one shape whatever the batch)."""
        if self.num_experts > self.INVARIANT_DENSE_EXPERTS:
            return self._routed_rows(x, experts)  # each expert's products in row blocks
        per_token = lambda rows, ids: self._every_expert(rows, ids).unflatten(0, (len(rows), self.top_k))  # noqa: E731
        return invariance.in_row_blocks(per_token, x, experts).flatten(0, 1)

    @staticmethod
    def _weighted_sum(per_slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``[T * k, H]`` products in (token, slot) order, weighted and summed over the slots in at least float32."""
        cd = compute_dtype(per_slot.dtype)
        num_tokens, top_k = weights.shape
        return (per_slot.view(num_tokens, top_k, -1).to(cd) * weights.to(cd)[..., None]).sum(dim=1)

    @property
    def may_run_dense(self) -> bool:
        return self.num_experts <= self.DENSE_MAX_WASTE * self.top_k

    def runs_dense(self, num_tokens: int) -> bool:
        """Whether a batch of ``num_tokens`` tokens takes the dense schedule."""
        return self.may_run_dense and num_tokens * self.top_k <= self.DENSE_MAX_ROWS_PER_EXPERT * self.num_experts

    def prepack_weights(self) -> None:
        """Serving copies (what :func:`specdec.models.layers.prepack_weights` calls): for a half type the
        CPU has no kernels for (:func:`~specdec.backends.base.math_dtype`), float32 copies laid out for
        ``x @ copy``; for a MoE that may run dense, its experts as two wide layers (:meth:`_dense`),
        each prepacked as a :class:`~specdec.models.layers.Linear` is."""
        weight = self.gate_up_proj
        if math_dtype(weight.dtype, weight.device) != weight.dtype:
            self.prepacked = tuple(
                w.detach().to(torch.float32).transpose(1, 2).contiguous() for w in (self.gate_up_proj, self.down_proj)
            )
        if self.may_run_dense:
            gate_up = self.gate_up_proj.detach().flatten(0, 1)  # [E * 2I, H]: every expert's gate|up rows
            down = self.down_proj.detach().transpose(0, 1).flatten(1).contiguous()  # [H, E * I]
            self.wide = (gate_up, onednn_prepack(gate_up)), (down, onednn_prepack(down))

    def _apply(self, fn, recurse: bool = True):
        self.prepacked = self.wide = None  # moved or cast: the copies no longer match
        return super()._apply(fn, recurse)

    def _product(self, x: torch.Tensor, part: int, expert: int | None = None) -> torch.Tensor:
        """``x`` through the gate/up (``part`` 0) or down (1) weights of every expert (``[E, T, out]``)
        or of ``expert`` (``[T, out]``); from the float32 copy, when there is one, rounded once."""
        if expert is not None and invariance.enabled():
            return invariance.in_row_blocks(lambda rows: self._expert_product(rows, part, expert), x)
        return self._expert_product(x, part, expert)

    def _expert_product(self, x: torch.Tensor, part: int, expert: int | None) -> torch.Tensor:
        weight = (self.gate_up_proj, self.down_proj)[part]
        copy = None if self.prepacked is None or weight.requires_grad else self.prepacked[part]
        if copy is not None:
            return torch.matmul(x.to(copy.dtype), copy if expert is None else copy[expert]).to(x.dtype)
        if expert is not None:
            return F.linear(x, weight[expert])
        return torch.matmul(x, weight.transpose(1, 2))

    def _dense(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The MoE sum ``[T, H]`` from every expert on every token, as two wide layers: gate|up of all
        experts in one GEMM, then their down projections in one GEMM over the activations, each scaled
        by its token's routing weight for that expert (zero for the experts it does not route to), so
        the GEMM's own accumulation sums the slots.

        On the zoo's MoEs (bf16) it takes half the time of the batched matmuls at 1 to 4 tokens. The
        activation and the scaling run in at least float32 and round once, as the matmuls' outputs
        were, so the sum is as close to float64's (3.4e-3 relative against 3.8e-3)."""
        num_tokens, cd = x.shape[0], compute_dtype(x.dtype)
        (gate_up, gate_up_packed), (down, down_packed) = self.wide
        per_expert = torch.zeros(num_tokens, self.num_experts, dtype=cd, device=x.device)
        per_expert.scatter_add_(1, experts, weights.to(cd))  # a token routed twice to one expert: both slots
        hidden = linear(x, gate_up, prepacked=gate_up_packed).view(num_tokens, self.num_experts, -1)
        hidden = (self.activation(hidden.to(cd)) * per_expert[..., None]).to(x.dtype)
        return linear(hidden.flatten(1), down, prepacked=down_packed).to(cd)

    def _every_expert(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``[T * k, H]`` outputs in (token, slot) order, from all ``E`` experts run on all tokens."""
        gate_up = self._product(x, 0)  # [E, T, 2I]
        out = self._product(self.activation(gate_up), 1)  # [E, T, H]
        token = torch.arange(x.shape[0], device=x.device)[:, None]
        return out[experts, token].flatten(0, 1)

    def _routed_rows(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``[T * k, H]`` outputs in (token, slot) order, each expert run once over its routed tokens."""
        top_k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[token]
        out_rows = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                seg = self.activation(self._product(rows[start : start + n], 0, e))
                out_rows[start : start + n] = self._product(seg, 1, e)
                start += n
        unsorted = torch.empty_like(out_rows)
        unsorted[order] = out_rows
        return unsorted


_PER_EXPERT = re.compile(
    r"^(.*)\.(block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
# Each spelling's (gate, up, down) names: MiniMax's hub w1/w3/w2, transformers' *_proj.
_SPELLINGS = {part: ("w1", "w3", "w2") for part in ("w1", "w2", "w3")}
_SPELLINGS.update({part: ("gate_proj", "up_proj", "down_proj") for part in ("gate_proj", "up_proj", "down_proj")})


def expert_slice(name: str, num_experts: int, intermediate_size: int) -> SliceTarget | None:
    """Per-expert checkpoint name -> the slice of the stacked ``<layer>.mlp.experts`` tensors it fills.

    None when ``name`` is not a per-expert tensor. The module path before ``.mlp`` /
    ``.block_sparse_moe`` is kept as it is; a missing layer or expert shows up as unexpected. The
    slice is in this rank's rows (``intermediate_size`` is the config's; the loader cuts the tensor).
    """
    intermediate_size //= ps.current().size
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    layer, container, expert, part = match.group(1), match.group(2), int(match.group(3)), match.group(4)
    if not 0 <= expert < num_experts:
        raise CheckpointError(
            f"unexpected tensor {name!r} in the checkpoint: it names expert {expert}, "
            f"the model has {num_experts} experts"
        )
    gate, up, down = _SPELLINGS[part]
    pieces = functools.partial(
        _expert_pieces, f"{layer}.{container}.experts", (gate, up, down), num_experts, intermediate_size, part == down
    )
    if part == down:
        return SliceTarget(f"{layer}.mlp.experts.down_proj", (expert,), pieces)
    rows = slice(0, intermediate_size) if part == gate else slice(intermediate_size, 2 * intermediate_size)
    return SliceTarget(f"{layer}.mlp.experts.gate_up_proj", (expert, rows), pieces)


def _expert_pieces(
    prefix: str, spelling: tuple[str, str, str], num_experts: int, intermediate_size: int, down: bool
) -> list[tuple[tuple, str]]:
    """Every per-expert tensor of one stacked parameter, in the spelling the checkpoint used."""
    gate, up, down_name = spelling
    if down:
        return [((e,), f"{prefix}.{e}.{down_name}.weight") for e in range(num_experts)]
    return [
        piece
        for e in range(num_experts)
        for piece in row_pieces(
            [(f"{prefix}.{e}.{gate}.weight", intermediate_size), (f"{prefix}.{e}.{up}.weight", intermediate_size)],
            lead=(e,),
        )
    ]
