"""Tensor names of the EAGLE3 checkpoint layouts in the wild, folded onto the draft module's names.

Layouts (FACTS.md section 3): ``midlayer.*`` (EAGLE reference, SGLang / SpecForge), ``model.midlayer.*``
(accepted by SGLang), ``layers.0.*`` and ``model.layers.0.*`` (vLLM's naming, e.g. the MiniMax-M3
draft). The module calls its decoder layer ``midlayer``; every other top-level name (``fc``,
``fc_norm.{i}``, ``input_norm``, ``norm``, ``embed_tokens``, ``lm_head``, ``d2t``, ``t2d``) is the same
in all layouts, with or without a ``model.`` prefix.
"""

from __future__ import annotations

import re
from pathlib import Path

from safetensors import safe_open

from specdec.models.loader import CheckpointError, safetensors_files

_LAYER = re.compile(r"^(?:midlayer|layers\.(\d+))\.(.+)$")


def canonical_name(name: str) -> str | None:
    """The draft module's name for a checkpoint tensor, or None for tensors that are recomputed."""
    bare = name[len("model.") :] if name.startswith("model.") else name
    if bare.endswith("rotary_emb.inv_freq"):
        return None
    match = _LAYER.match(bare)
    return f"midlayer.{match.group(2)}" if match else bare


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Shapes of a draft's tensors by canonical name, read from the safetensors headers only.

    Raises :class:`CheckpointError` for a draft with more than one decoder layer, or one that holds the
    same tensor under two layouts' names (it would load one and silently drop the other).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    origin: dict[str, str] = {}
    layers: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
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
                shapes[canon], origin[canon] = tuple(f.get_slice(name).get_shape()), name
    if len(layers) > 1:
        names = sorted("midlayer" if n == "midlayer" else f"layers.{n}" for n in layers)
        raise CheckpointError(
            f"draft {str(path)!r} has decoder layers {names}; an EAGLE3 draft has exactly one"
        )
    return shapes
