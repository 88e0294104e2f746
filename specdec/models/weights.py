"""Copy checkpoint tensors into a module by name, with errors that say what does not fit."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from specdec.models.loader import CheckpointError


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    rename: Callable[[str], str | None] | None = None,
    optional: Callable[[str], bool] | None = None,
) -> None:
    """Copy each ``(name, tensor)`` into the parameter or buffer of the same name (after ``rename``).

    ``rename`` maps a checkpoint name to the module's name, or to None to skip the tensor on purpose
    (e.g. MTP layers the engine does not run). Every parameter must be filled exactly once unless
    ``optional(name)`` says it may be absent (e.g. a tied ``lm_head``); anything else raises
    :class:`CheckpointError` naming the tensors.
    """
    targets = dict(module.named_parameters())
    targets.update(dict(module.named_buffers()))
    loaded: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name) if rename else ckpt_name
        if name is None:
            continue
        target = targets.get(name)
        if target is None:
            unexpected.append(ckpt_name)
            continue
        if tuple(target.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name)
    if unexpected:
        raise CheckpointError(f"unexpected tensors in the checkpoint: {_names(unexpected)}")
    missing = [n for n in dict(module.named_parameters()) if n not in loaded and not (optional and optional(n))]
    if missing:
        raise CheckpointError(f"tensors missing from the checkpoint: {_names(missing)}")


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
