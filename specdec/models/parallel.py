"""Tensor-parallel building blocks: sharded linears, the vocab-parallel embedding and LM head.

Each layer takes its rank's slice of the weights (sizes from :func:`specdec.distributed.parallel_state.current`
at construction) and declares in ``tp_shards`` how that slice is cut from the checkpoint's full tensor
(:class:`ShardSpec`, :class:`PartsShard`); the loader (:func:`specdec.models.weights.load_named_weights`)
cuts each tensor as it streams in, so no rank ever holds another rank's weights.

- :class:`ColumnParallelLinear`: output rows split; each rank's output is its own heads / features.
- :class:`RowParallelLinear`: input columns split; partial products are summed over the ranks.
- :class:`VocabParallelEmbedding`, :class:`VocabParallelHead`: vocabulary rows split (padded to a
  multiple of the rank count); an LM head gathers its logits only to sample, and reduces a greedy
  choice to (max, id) per rank (:func:`~specdec.distributed.parallel_state.gather_vocab`,
  :func:`~specdec.distributed.parallel_state.argmax_vocab`).

With one rank every layer is the plain layer it replaces, bit for bit.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specdec.distributed import parallel_state as ps
from specdec.models.layers import Linear, linear


@attrs.frozen
class ShardSpec:
    """Rank ``index`` of ``count`` takes the ``index``-th of ``count`` equal chunks along ``dim``, after
    zero-padding that dimension to ``padded`` (a vocabulary that the rank count does not divide)."""

    dim: int
    index: int
    count: int
    padded: int | None = None

    @property
    def is_whole(self) -> bool:
        """Whether the slice is the whole tensor (one rank)."""
        return self.count == 1 and self.padded is None

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        dim = self.dim % tensor.dim()
        if self.padded is not None and tensor.shape[dim] < self.padded:
            pad = [0, 0] * (tensor.dim() - dim - 1) + [0, self.padded - tensor.shape[dim]]
            tensor = F.pad(tensor, pad)
        return tensor.chunk(self.count, dim=dim)[self.index]


@attrs.frozen
class PartsShard:
    """A tensor of consecutive parts along ``dim`` (``(full width, spec)`` each: q|k|v, gate|up), each
    part cut by its own spec, the slices concatenated in order."""

    dim: int
    parts: tuple[tuple[int, ShardSpec], ...]

    @property
    def is_whole(self) -> bool:
        return all(spec.is_whole for _, spec in self.parts)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        pieces = tensor.split([width for width, _ in self.parts], dim=self.dim)
        return torch.cat([spec.take(piece) for piece, (_, spec) in zip(pieces, self.parts)], dim=self.dim)


def split_spec(dim: int = 0) -> ShardSpec:
    """This rank's equal share along ``dim``."""
    tp = ps.current()
    return ShardSpec(dim, tp.rank, tp.size)


@attrs.frozen
class HeadShard:
    """This rank's share of ``total`` heads: ``local`` heads starting at head ``first``.

    Heads split evenly when the ranks divide them; fewer heads than ranks (KV heads under GQA) are
    replicated, each rank taking the head its query heads read."""

    local: int
    spec: ShardSpec

    @classmethod
    def split(cls, total: int, what: str) -> "HeadShard":
        """An even split (query heads); a one-line error naming ``what`` when the ranks do not divide it."""
        tp = ps.current()
        return cls(tp.shard(total, what), ShardSpec(0, tp.rank, tp.size))

    @classmethod
    def of(cls, total: int, what: str) -> "HeadShard":
        """KV heads: an even split, or, with fewer heads than ranks (dividing them), the one head this
        rank's query heads read."""
        tp = ps.current()
        if total >= tp.size or tp.size % total:
            return cls.split(total, what)
        return cls(1, ShardSpec(0, tp.rank * total // tp.size, total))


class ColumnParallelLinear(Linear):
    """``Linear`` whose output features are split over the ranks (each rank computes its own)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, what: str = "out_features"):
        local = ps.current().shard(out_features, what)
        super().__init__(in_features, local, bias=bias)
        self.tp_shards = {"weight": split_spec(0), "bias": split_spec(0)}


class RowParallelLinear(Linear):
    """``Linear`` whose input features are split over the ranks; the partial outputs are summed
    (one all-reduce) and the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, what: str = "in_features"):
        self.tp = ps.current()
        super().__init__(self.tp.shard(in_features, what), out_features, bias=bias)
        self.tp_shards = {"weight": split_spec(1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = ps.all_reduce(self.tp, linear(x, self.weight, None, self.prepacked))
        return y if self.bias is None else y + self.bias


def padded_vocab(vocab_size: int) -> int:
    """The vocabulary rounded up to a multiple of the rank count."""
    size = ps.current().size
    return -(-vocab_size // size) * size


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` over this rank's rows of the (padded) vocabulary; rows of other ranks' ids are
    zero here and the ranks' lookups are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp = tp = ps.current()
        self.num_embeddings = num_embeddings
        local = padded_vocab(num_embeddings) // tp.size
        self.vocab_start = tp.rank * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim))
        self.tp_shards = {"weight": ShardSpec(0, tp.rank, tp.size, padded_vocab(num_embeddings))}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return ps.all_reduce(self.tp, out.masked_fill(outside[:, None], 0))


class VocabParallelHead(nn.Module):
    """An LM head (``[vocab, hidden]``, no bias) over this rank's rows of the padded vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        tp = ps.current()
        self.weight = nn.Parameter(torch.empty(padded_vocab(vocab_size) // tp.size, hidden_size))
        self.tp_shards = {"weight": ShardSpec(0, tp.rank, tp.size, padded_vocab(vocab_size))}
