"""Building blocks shared by the model implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specdec.backends import invariance
from specdec.backends.base import math_dtype
from specdec.distributed import parallel_state as ps


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for norms and softmax-like reductions: at least float32, float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """RMSNorm with the reduction in at least float32 (as transformers does for half precision).

    ``unit_offset`` is Gemma's ``(1 + weight)`` scaling.
    """

    prepared: torch.Tensor | None = None  # ``1 + weight`` in the reduction's dtype, after prepack_weights

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def prepack_weights(self) -> None:
        """Serving: keep Gemma's ``1 + weight`` in the reduction's dtype (two ops of every call otherwise)."""
        if self.unit_offset:
            self.prepared = 1.0 + self.weight.detach().to(compute_dtype(self.weight.dtype))

    def _apply(self, fn, recurse: bool = True):
        self.prepared = None  # moved or cast: the copy no longer matches
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused rms_norm: the same x * rsqrt(mean(x^2) + eps) * weight, rounded once at the end,
        # in a third of the dispatched ops (bit for bit the unfused formula on CPU). It accumulates half
        # types in float32 itself, so a weight of x's dtype needs no casts; (1 + weight) does.
        if not self.unit_offset and self.weight.dtype == x.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        work = compute_dtype(x.dtype)
        weight = self.prepared
        if weight is None or weight.dtype != work or self.weight.requires_grad:
            weight = self.weight.to(work)
            if self.unit_offset:
                weight = 1.0 + weight
        return F.rms_norm(x.to(work), (x.shape[-1],), weight, self.eps).to(x.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return invariance.silu(gate) * up


def activation(name: str):
    """``ACT2FN[name]``, with SiLU as :func:`~specdec.backends.invariance.silu` (batch-invariant in the mode)."""
    if name not in ACT2FN:
        raise ValueError(f"unknown hidden_act {name!r}; choose one of {sorted(ACT2FN)}")
    return invariance.silu if name in ("silu", "swish") else ACT2FN[name]


# oneDNN's prepacked CPU GEMM (what inductor's CPU weight freezing uses). For the few-row products of
# decode and verify, MKL's float32 sgemm costs 2-3x more at 4 rows than at 1; the prepacked kernel
# keeps a 4-row verify near a 1-row decode and is faster at 1 row too. bfloat16 already runs on
# oneDNN, and saves the per-call weight reorder.
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
_PREPACK_ROWS = 4  # the layout is tuned for this many input rows; any count runs


def onednn_prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """The copy of ``weight [out, in]`` that :func:`linear` serves from, or None where ``F.linear`` on
    ``weight`` is what runs (not on the CPU, a dtype oneDNN does not prepack, a torch without oneDNN):

    - a half type the CPU has no GEMMs for (:func:`~specdec.backends.base.math_dtype`): a float32 copy,
      ``[in, out]``. On an AVX2 CPU it runs a bf16 layer 3-4x faster than bf16 at 8 rows, and MKL's
      sgemm on that layout beats both ``[out, in]`` and oneDNN's at 1 row (1.5-3x), level at 4-32 rows.
      It costs twice the half weight's memory, beside it.
    - otherwise (float32; bf16 where oneDNN has bf16 GEMMs): oneDNN's blocked layout.

    The copy is separate from ``weight``: prepack again after changing the weight."""
    if weight.device.type != "cpu":
        return None
    if math_dtype(weight.dtype, weight.device) != weight.dtype:
        return weight.detach().to(torch.float32).t().contiguous()
    if not _ONEDNN or weight.dtype not in (torch.float32, torch.bfloat16):  # bf16 here: oneDNN has its GEMMs
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PREPACK_ROWS)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, prepacked: torch.Tensor | None = None,
    quantized=None,
) -> torch.Tensor:
    """``F.linear``, through ``prepacked`` (:func:`onednn_prepack` of ``weight``) when given and the
    weight needs no gradient (the prepacked copy is outside autograd), or through ``quantized`` (a
    :class:`~specdec.models.quantization.PackedWeight` of the same values) where it serves ``x``. In
    the batch-invariant mode the rows run in fixed blocks
    (:func:`~specdec.backends.invariance.in_row_blocks`), never through ``quantized``."""
    if invariance.enabled():
        rows = x.reshape(-1, x.shape[-1])
        y = invariance.in_row_blocks(lambda block: _linear(block, weight, bias, prepacked), rows)
        return y.view(*x.shape[:-1], y.shape[-1])
    if quantized is not None and quantized.serves(x):
        y = quantized(x)
        return y if bias is None else y + bias
    return _linear(x, weight, bias, prepacked)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prepacked: torch.Tensor | None):
    if prepacked is None or weight.requires_grad:
        return F.linear(x, weight, bias)
    if prepacked.dtype != weight.dtype:  # a half layer's float32 copy: round once, where its GEMM would
        y = torch.matmul(x.to(torch.float32), prepacked)
        return (y if bias is None else y.add_(bias)).to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, prepacked, bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` that runs on a prepacked copy of its weight after :meth:`prepack_weights`.

    Models build their projections from it; serving calls :func:`prepack_weights` once the weights are
    loaded. Training never prepacks, so autograd sees a plain ``F.linear``.
    """

    prepacked: torch.Tensor | None = None
    quantized = None  # a PackedWeight of the weight's values (specdec.models.quantization)

    def prepack_weights(self) -> None:
        self.prepacked = onednn_prepack(self.weight)

    def _apply(self, fn, recurse: bool = True):
        self.prepacked = self.quantized = None  # moved or cast (.to, .double(), ...): the copies no longer match
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.prepacked, self.quantized)


class PrepackedLMHead:
    """Mixin for a model's ``compute_logits`` over ``output_weight()`` (its own head, or the tied or
    shared rows it reads), served from a prepacked copy after :meth:`prepack_weights`.

    Under tensor parallelism ``output_weight()`` holds this rank's rows of the vocabulary:
    :meth:`compute_logits` gathers every rank's logits, :meth:`greedy_ids` only each rank's best.
    The model's constructor calls :meth:`bind_vocab_group` (the group it was built for).
    """

    _prepacked_head: torch.Tensor | None = None
    # After quantize_head: the rows the logits read instead of output_weight(), and their packed copy.
    _quantized_rows: torch.Tensor | None = None
    _quantized_head = None
    vocab_group: "ps.TensorParallelGroup" = ps.SINGLE

    def bind_vocab_group(self) -> None:
        """Split the vocabulary over the group being built (:func:`specdec.distributed.parallel_state.current`)."""
        self.vocab_group = ps.current()

    def output_weight(self) -> torch.Tensor:
        """The ``[vocab, hidden]`` rows the logits project onto (this rank's, under tensor parallelism)."""
        raise NotImplementedError

    @property
    def output_vocab_size(self) -> int:
        """How many logits :meth:`compute_logits` returns per row."""
        return self.vocab_size

    def logits_weight(self) -> torch.Tensor:
        """The rows the logits project onto: ``output_weight()``, or its quantized copy (:meth:`quantize_head`)."""
        return self.output_weight() if self._quantized_rows is None else self._quantized_rows

    def quantize_head(self, rows: torch.Tensor, packed) -> None:
        """Read the logits off ``rows`` (``output_weight()`` quantized, a copy: those rows may be shared)
        and their :class:`~specdec.models.quantization.PackedWeight` ``packed`` (or None) from now on."""
        self._quantized_rows, self._quantized_head = rows, packed
        self._prepacked_head = onednn_prepack(rows)

    def local_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over this rank's rows of the vocabulary (all of them with one rank)."""
        return linear(hidden_states, self.logits_weight(), prepacked=self._prepacked_head, quantized=self._quantized_head)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return ps.gather_vocab(self.vocab_group, self.local_logits(hidden_states), self.output_vocab_size)

    def greedy_ids(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The argmax over the vocabulary of each row's logits (first on ties), without gathering them."""
        local = self.local_logits(hidden_states)
        return ps.argmax_vocab(self.vocab_group, local.to(compute_dtype(local.dtype)), self.output_vocab_size)

    def prepack_weights(self) -> None:
        """Prepack the output weight; :func:`prepack_weights` calls this beside each layer's own."""
        self._prepacked_head = onednn_prepack(self.logits_weight())

    def _apply(self, fn, recurse: bool = True):
        # Moved or cast: the copies no longer match (quantize again after moving or casting).
        self._prepacked_head = self._quantized_rows = self._quantized_head = None
        return super()._apply(fn, recurse)


def prepack_weights(model: nn.Module) -> None:
    """Get a loaded model ready to serve: every submodule with a ``prepack_weights`` method (each
    :class:`Linear`, the LM heads, the experts) prepacks its weights where that pays
    (:func:`onednn_prepack`); Gemma-style norms keep their ``1 + weight``."""
    for module in model.modules():
        hook = getattr(module, "prepack_weights", None)
        if callable(hook):
            hook()


class PackedLinear(Linear):
    """Several checkpoint linears over the same input, stacked along the output rows and run as one
    GEMM (q/k/v, gate/up): at decode sizes a matmul costs its dispatch more than its arithmetic.

    ``parts`` maps each checkpoint module name (``"q_proj"``) to its output width, in row order. The
    checkpoint keeps the separate tensors: :func:`specdec.models.weights.load_named_weights` fills each
    part's rows from ``<parent>.<part>.weight`` (and ``.bias``), and :meth:`split` cuts an output back
    into the parts' views. Under tensor parallelism ``parts`` are this rank's widths and ``shards`` say
    which rows of each full part they are.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False, shards: dict | None = None):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)
        self._widths = list(self.parts.values())
        # Tensor parallelism: how each part's rows are cut from the checkpoint's full part
        # (a :class:`~specdec.models.parallel.ShardSpec` per part; none = the parts are whole).
        self.part_shards = dict(shards or {})

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts of an output ``[..., out_features]``, each ``[..., width]`` (views)."""
        return y.split(self._widths, dim=-1)

    def part_rows(self) -> dict[str, slice]:
        """The rows of the weight (and bias) each part fills."""
        rows, start = {}, 0
        for name, width in self.parts.items():
            rows[name] = slice(start, start + width)
            start += width
        return rows


def gated_projections(hidden_size: int, intermediate_size: int, bias: bool = False) -> tuple[PackedLinear, Linear]:
    """``gate_up_proj`` (gate and up packed, column-parallel part by part) and ``down_proj``
    (row-parallel) of a gated MLP, over this rank's share of ``intermediate_size``."""
    from specdec.models.parallel import RowParallelLinear, split_spec

    local = ps.current().shard(intermediate_size, "the MLP's intermediate_size")
    gate_up = PackedLinear(hidden_size, {"gate_proj": local, "up_proj": local}, bias=bias,
                           shards={"gate_proj": split_spec(0), "up_proj": split_spec(0)})
    return gate_up, RowParallelLinear(intermediate_size, hidden_size, bias=bias)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (SwiGLU for ``"silu"``), gate and up run as one
    :class:`PackedLinear` (``gate_up_proj``, filled from the checkpoint's ``gate_proj`` / ``up_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj, self.down_proj = gated_projections(hidden_size, intermediate_size, bias)
        self.act = None if hidden_act == "silu" else activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        inner = silu_and_mul(gate, up) if self.act is None else self.act(gate) * up
        return self.down_proj(inner)


class RotaryEmbedding(nn.Module):
    """RoPE for the variants transformers implements (default, linear, llama3, yarn, ...).

    The inverse frequencies and attention scaling come from transformers' own RoPE init functions,
    so every ``rope_parameters`` / legacy ``rope_scaling`` spelling a config can carry is honoured.
    ``rotary_dim`` below the head dim gives partial RoPE; ``interleaved`` is the GPT-J pairing
    (DeepSeek's ``rope_interleave``), otherwise NeoX halves.
    """

    def __init__(self, config, rotary_dim: int, *, interleaved: bool = False):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(
                f"rope_type {rope_type!r} changes with the sequence length and is not supported yet; "
                "use a checkpoint with default, linear, llama3 or yarn RoPE"
            )
        self._config = config
        self._rope_type = rope_type
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the frequency table on the CPU; called after meta-device construction."""
        if self._rope_type == "default":
            theta = self._config.rope_parameters["rope_theta"]
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device="cpu").float() / self.rotary_dim
            inv_freq, scaling = 1.0 / (theta**exponents), 1.0
        else:
            # Some init functions create tensors without a device: pin them to the CPU, since the
            # loader builds models under a meta-device context.
            with torch.device("cpu"):
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[self._rope_type](self._config, device="cpu")
        # Tables stay in float32 whatever the model dtype: that is how checkpoints are trained and how
        # transformers evaluates them, so float64 runs agree with it to rounding.
        self.inv_freq = inv_freq.float()
        self.attention_scaling = float(scaling)
        # cos, sin and the rotation's signed sin of every position (per dtype and device), so a forward
        # only indexes them.
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, ...]] = {}
        self.max_positions = int(getattr(self._config, "max_position_embeddings", None) or 4096)

    def _table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(cos, sin, signed_sin)`` tables with a row for every position in ``positions``."""
        tables = self._tables.get((dtype, positions.device))
        if positions.device.type == "cpu":
            # Rows up to a power of two past the largest position seen (reading it is free on the CPU).
            need = 1 << int(positions.max()).bit_length() if positions.numel() else 1
        else:
            need = self.max_positions  # one table up front: no host sync in the forward
        if tables is None or tables[0].shape[0] < need:
            rows = max(need, min(4096, self.max_positions))
            tables = self._compute_table(torch.arange(rows, device=positions.device), dtype)
            self._tables[(dtype, positions.device)] = tables
        return tables

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[T, rotary_dim]`` at ``positions``, laid out like the channels they rotate
        (``[c, c]`` halves for NeoX, ``c0 c0 c1 c1 ...`` pairs when interleaved)."""
        cos, sin, _ = self._table(positions, dtype)
        return cos[positions], sin[positions]

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`rotate` multiplies by at ``positions``: ``cos`` and the signed ``sin`` (negated on
        the channels whose partner enters with a minus), both ``[T, 1, rotary_dim]``."""
        cos, _, signed_sin = self._table(positions, dtype)
        return cos[positions].unsqueeze(1), signed_sin[positions].unsqueeze(1)

    def _compute_table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        freqs = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        sign = torch.ones(self.rotary_dim, device=positions.device)
        if self.interleaved:
            sign[0::2] = -1.0
        else:
            sign[: self.rotary_dim // 2] = -1.0
        return cos.to(dtype), sin.to(dtype), (sin * sign).to(dtype)

    def forward(self, positions: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each ``[T, heads, head_dim]`` tensor's first ``rotary_dim`` features by position."""
        cos, signed_sin = self.rotation(positions, tensors[0].dtype)
        return tuple(self.rotate(t, cos, signed_sin) for t in tensors)

    def at(self, positions: torch.Tensor) -> "PositionedRotary":
        """This RoPE for one forward's ``positions``: every layer reuses one cos/sin table."""
        return PositionedRotary(self, positions)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """``x * cos + partner(x) * signed_sin`` on the first ``rotary_dim`` channels, with the tables from
        :meth:`rotation`. ``partner`` swaps each channel with the one it rotates with (the other half
        for NeoX, the neighbour when interleaved); the sign lives in the table, so this is the
        textbook ``x * cos + rotate_half(x) * sin`` bit for bit, in four ops."""
        dim = self.rotary_dim
        rot = x[..., :dim] if dim < x.shape[-1] else x
        if self.interleaved:
            partner = rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        else:
            partner = rot.roll(dim // 2, dims=-1)
        out = rot * cos + partner * signed_sin
        return torch.cat((out, x[..., dim:]), dim=-1) if dim < x.shape[-1] else out


class PositionedRotary:
    """A :class:`RotaryEmbedding` bound to one forward's positions, called like the module itself.

    The cos/sin table of those positions is computed once per dtype and shared by every layer (and
    by MiniMax-M3's indexers); other positions fall through to the module. It lives for one forward,
    so the positions it holds never change under it.
    """

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor):
        self.rotary = rotary
        self.positions = positions
        self.rotary_dim = rotary.rotary_dim
        self._tables: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self._memo("cos_sin", positions, dtype)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self._memo("rotation", positions, dtype)

    def _memo(self, kind: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is not self.positions:
            return getattr(self.rotary, kind)(positions, dtype)
        tables = self._tables.get((kind, dtype))
        if tables is None:
            tables = self._tables[(kind, dtype)] = getattr(self.rotary, kind)(positions, dtype)
        return tables

    def __call__(self, positions: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cos, signed_sin = self.rotation(positions, tensors[0].dtype)
        return tuple(self.rotary.rotate(t, cos, signed_sin) for t in tensors)
