"""Tensor names of the EAGLE3 checkpoint layouts in the wild, folded onto the draft module's names.

Layouts (FACTS.md section 3): ``midlayer.*`` (EAGLE reference, SGLang / SpecForge), ``model.midlayer.*``
(accepted by SGLang), ``layers.0.*`` and ``model.layers.0.*`` (vLLM's naming, e.g. the MiniMax-M3
draft). The module calls its decoder layer ``midlayer``; every other top-level name (``fc``,
``fc_norm.{i}``, ``input_norm``, ``norm``, ``embed_tokens``, ``lm_head``, ``d2t``, ``t2d``) is the same
in all layouts, with or without a ``model.`` prefix. Weights come from safetensors files, or from a
``pytorch_model.bin`` (read with ``weights_only``) when the folder has no safetensors.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from specdec.models.loader import CheckpointError, iter_safetensors, safetensors_files

# The EAGLE reference publishes some drafts as a single PyTorch pickle instead of safetensors.
_TORCH_FILE = "pytorch_model.bin"

_LAYER = re.compile(r"^(?:midlayer|layers\.(\d+))\.(.+)$")


def canonical_name(name: str) -> str | None:
    """The draft module's name for a checkpoint tensor, or None for tensors that are recomputed."""
    bare = name[len("model.") :] if name.startswith("model.") else name
    if bare.endswith("rotary_emb.inv_freq"):
        return None
    match = _LAYER.match(bare)
    return f"midlayer.{match.group(2)}" if match else bare


def _torch_file(path: str | Path) -> Path | None:
    """``pytorch_model.bin`` when the folder has no safetensors at all, else None."""
    folder = Path(path)
    if any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file():
        return None
    file = folder / _TORCH_FILE
    return file if file.is_file() else None


def _load_torch_file(file: Path) -> dict[str, torch.Tensor]:
    # weights_only refuses arbitrary pickled objects; mmap avoids reading the whole file up front.
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        detail = " ".join(str(err).split())
        raise CheckpointError(f"cannot read {str(file)!r} as a tensor state dict: {detail}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{str(file)!r} does not hold a flat name -> tensor state dict")
    return state


def iter_draft_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` from the folder's safetensors, or its ``pytorch_model.bin``."""
    file = _torch_file(path)
    if file is None:
        yield from iter_safetensors(path)
    else:
        yield from _load_torch_file(file).items()


def _names_and_shapes(path: str | Path) -> Iterator[tuple[str, tuple[int, ...]]]:
    file = _torch_file(path)
    if file is not None:
        for name, tensor in _load_torch_file(file).items():
            yield name, tuple(tensor.shape)
        return
    for shard in safetensors_files(path):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                yield name, tuple(f.get_slice(name).get_shape())


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Shapes of a draft's tensors by canonical name, read from the safetensors headers only.

    Raises :class:`CheckpointError` for a draft with more than one decoder layer, or one that holds the
    same tensor under two layouts' names (it would load one and silently drop the other).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    origin: dict[str, str] = {}
    layers: set[str] = set()
    for name, shape in _names_and_shapes(path):
        canon = canonical_name(name)
        if canon is None:
            continue
        bare = name[len("model.") :] if name.startswith("model.") else name
        match = _LAYER.match(bare)
        if match:
            layers.add(match.group(1) or "midlayer")
        if canon in shapes:
            raise CheckpointError(
                f"draft {str(path)!r} holds {canon!r} twice, as {origin[canon]!r} and {name!r}; keep one layout"
            )
        shapes[canon], origin[canon] = shape, name
    if len(layers) > 1:
        names = sorted("midlayer" if n == "midlayer" else f"layers.{n}" for n in layers)
        raise CheckpointError(
            f"draft {str(path)!r} has decoder layers {names}; an EAGLE3 draft has exactly one"
        )
    return shapes
