"""What target and draft training runs share: the run options and the ``training.json`` record."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs

from specdec.train.corpus import CorpusConfig

_optional_count = attrs.validators.optional(attrs.validators.ge(1))


@attrs.frozen(kw_only=True)
class RunOptions:
    """Options of one training run; a subclass adds ``preset`` (with ``steps`` and ``quick_steps``)."""

    steps: int | None = attrs.field(default=None, validator=_optional_count)
    quick: bool = False  # use the preset's quick_steps (about a tenth of the full run)
    seed: int = 0
    threads: int | None = attrs.field(default=None, validator=_optional_count)
    autocast: bool = True  # bf16 autocast; False trains in plain fp32
    progress: bool = True
    corpus: CorpusConfig = attrs.field(factory=CorpusConfig)

    def __attrs_post_init__(self) -> None:
        if self.steps is not None and self.quick:
            raise ValueError("give either steps or quick, not both: quick means the preset's quick_steps")

    @property
    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        return self.preset.quick_steps if self.quick else self.preset.steps  # type: ignore[attr-defined]


def write_training_record(folder: str | Path, metadata: dict) -> None:
    """``training.json``: how a checkpoint was made (presets, seeds, figures), as plain JSON."""
    (Path(folder) / "training.json").write_text(json.dumps(_jsonable(metadata), indent=2) + "\n")


def _jsonable(value):
    if isinstance(value, dict) or type(value).__name__ == "mappingproxy":
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
