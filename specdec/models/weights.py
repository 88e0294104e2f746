"""Copy checkpoint tensors into a module by name, with errors that say what does not fit.

Tensors stream in one at a time, so loading never holds a second copy of the weights. A checkpoint
tensor may fill a whole parameter or a slice of one (:class:`SliceTarget`: per-expert tensors of
stacked experts, split ``gate_proj`` / ``up_proj`` of a fused ``gate_up_proj``, the parts of every
:class:`~specdec.models.layers.PackedLinear`, which are found by themselves).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Iterator

import attrs
import torch
from torch import nn

from specdec.models.layers import PackedLinear
from specdec.models.loader import CheckpointError


@attrs.frozen
class SliceTarget:
    """A checkpoint tensor that fills ``param[index]``, one of the pieces that make up ``param``.

    ``pieces()`` lists every piece of ``param`` as ``(index, checkpoint name)``: the loader checks
    that all arrived and names the ones that did not.
    """

    param: str
    index: tuple
    pieces: Callable[[], Iterable[tuple[tuple, str]]] = attrs.field(eq=False, repr=False)


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    rename: Callable[[str], str | SliceTarget | None] | None = None,
    optional: Callable[[str], bool] | None = None,
) -> None:
    """Copy each ``(name, tensor)`` into the parameter or buffer of the same name (after ``rename``).

    ``rename`` maps a checkpoint name to the module's name, to a :class:`SliceTarget`, or to None to
    skip the tensor on purpose (e.g. MTP layers the engine does not run). Every parameter must be
    filled exactly once, whole or by all its pieces, unless ``optional(name)`` says it may be absent
    (e.g. a tied ``lm_head``); anything else raises :class:`CheckpointError` naming the tensors.
    """
    targets = dict(module.named_parameters())
    targets.update(dict(module.named_buffers()))
    packed = packed_part_targets(module)
    shards = shard_specs(module)
    loaded: set[str] = set()
    filled: dict[str, tuple[SliceTarget, set[tuple]]] = {}  # sliced param -> (a target, piece keys)
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name) if rename else ckpt_name
        if name is None:
            continue
        shard = shards.get(name + WHOLE if isinstance(name, str) else name.param + PIECE)
        if isinstance(name, str) and name not in targets:
            name = packed.get(name, name)
        sliced = isinstance(name, SliceTarget)
        target = targets.get(name.param if sliced else name)
        if target is None:
            unexpected.append(ckpt_name)
            continue
        dest = target.data[name.index] if sliced else target
        if shard is not None:
            tensor = shard.take(tensor)  # this rank's slice of the full tensor
        if tuple(dest.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor)
        if sliced:
            filled.setdefault(name.param, (name, set()))[1].add(_index_key(name.index))
        else:
            loaded.add(name)
    if unexpected:
        raise CheckpointError(f"unexpected tensors in the checkpoint: {_names(unexpected)}")
    missing = [
        n
        for n in dict(module.named_parameters())
        if n not in loaded and n not in filled and not (optional and optional(n))
    ]
    if missing:
        raise CheckpointError(f"tensors missing from the checkpoint: {_names(missing)}")
    partial = []
    for param, (target, got) in filled.items():
        pieces = {_index_key(index): name for index, name in target.pieces()}
        absent = [name for key, name in pieces.items() if key not in got]
        if absent:
            partial.append(f"{param} ({len(pieces) - len(absent)} of {len(pieces)} pieces): {_names(absent)}")
    if partial:
        raise CheckpointError(f"tensors missing from the checkpoint: parts of {'; '.join(partial)}")


def packed_part_targets(module: nn.Module) -> dict[str, SliceTarget]:
    """Where each part of every :class:`~specdec.models.layers.PackedLinear` in ``module`` loads from:
    ``<parent>.q_proj.weight`` -> rows of ``<parent>.qkv_proj.weight`` (and the same for biases)."""
    targets: dict[str, SliceTarget] = {}
    for path, child in module.named_modules():
        if not isinstance(child, PackedLinear):
            continue
        parent = path.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        for suffix in ("weight", "bias") if child.bias is not None else ("weight",):
            parts = [(f"{prefix}{part}.{suffix}", width) for part, width in child.parts.items()]
            pieces = functools.partial(row_pieces, parts)
            for index, name in pieces():
                targets[name] = SliceTarget(f"{path}.{suffix}", index, pieces)
    return targets


# Keys of :func:`shard_specs`: a whole parameter (or a packed part) by name, a piece of a sliced one.
WHOLE, PIECE = "", "#piece"


def shard_specs(module: nn.Module) -> dict[str, object]:
    """How each tensor-parallel parameter is cut from its checkpoint tensor, by the name the tensor
    loads under: ``<path>.<param>`` for a whole parameter or a :class:`PackedLinear` part, and
    ``<path>.<param>#piece`` for the pieces of a :class:`SliceTarget` (per-expert tensors).

    Modules declare them in ``tp_shards`` (parameter name, or ``name#piece``, to a spec with a
    ``take(tensor)`` method); a :class:`PackedLinear` in ``part_shards``, cut part by part whether the
    checkpoint holds the parts or the packed tensor. Nothing is declared with one rank.
    """
    from specdec.models.parallel import PartsShard

    specs: dict[str, object] = {}
    for path, child in module.named_modules():
        prefix = f"{path}." if path else ""
        for key, spec in getattr(child, "tp_shards", {}).items():
            specs[prefix + key] = spec
        if isinstance(child, PackedLinear) and child.part_shards:
            parent = path.rpartition(".")[0]
            parent_prefix = f"{parent}." if parent else ""
            parts = tuple((child.parts[p] * child.part_shards[p].count, child.part_shards[p]) for p in child.parts)
            for suffix in ("weight", "bias"):
                specs[f"{prefix}{suffix}"] = PartsShard(0, parts)
                for part in child.parts:
                    specs[f"{parent_prefix}{part}.{suffix}"] = child.part_shards[part]
    return {name: spec for name, spec in specs.items() if not spec.is_whole}


def checkpoint_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_parameters`` under checkpoint names: each :class:`~specdec.models.layers.PackedLinear`
    parameter comes as its parts (views of its rows, in order), so saving and initialising see the
    tensors, and the order, a checkpoint has."""
    packed = {path: child for path, child in module.named_modules() if isinstance(child, PackedLinear)}
    for name, param in module.named_parameters():
        path, _, suffix = name.rpartition(".")
        linear = packed.get(path)
        if linear is None:
            yield name, param
            continue
        parent = path.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        for part, rows in linear.part_rows().items():
            yield f"{prefix}{part}.{suffix}", param[rows]


def load_weights_with_slices(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | SliceTarget | None],
) -> None:
    """:func:`load_named_weights` with a ``rename`` that may return :class:`SliceTarget` s (kept for callers)."""
    load_named_weights(module, weights, rename=rename)


def row_pieces(parts: Iterable[tuple[str, int]], lead: tuple = ()) -> list[tuple[tuple, str]]:
    """Pieces stacked along rows: ``parts`` are ``(checkpoint name, rows)`` in order (gate, then up).

    ``lead`` indexes the dimensions before the rows (an expert): the pieces fill ``param[*lead, start:stop]``.
    """
    pieces, start = [], 0
    for name, rows in parts:
        pieces.append(((*lead, slice(start, start + rows)), name))
        start += rows
    return pieces


def _index_key(index: tuple) -> tuple:
    # Slices are unhashable before Python 3.12.
    return tuple((i.start, i.stop) if isinstance(i, slice) else i for i in index)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
