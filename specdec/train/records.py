"""What a trained checkpoint records beyond its weights, in the layouts public engines read.

- :func:`complete_target_config`: keys transformers leaves out of the configs it saves because it
  hard-codes their values, which public engines read: DeepSeek-V3's ``topk_method: "noaux_tc"`` and
  ``scoring_func: "sigmoid"`` (vLLM's ``deepseek_v2.py`` builds a softmax router without them).
- :func:`rewrite_draft_config`: an EAGLE3 draft's ``config.json`` as
  :meth:`~specdec.proposers.eagle3.Eagle3DraftConfig.to_dict` writes it (the 3.1 flags at the top
  level, where vLLM reads them, and in ``eagle_config``).
- :func:`record_target`: the draft's ``training.json`` names its target and the fingerprint of the
  target's weights (:func:`~specdec.proposers.draft_record.weights_fingerprint`), which serving checks.

Training applies them as it saves; ``scripts/build_zoo.py --refresh`` applies them to built assets.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.proposers.draft_record import RECORD_FILE, weights_fingerprint
from specdec.proposers.eagle3.config import Eagle3DraftConfig

PUBLIC_CONFIG_KEYS = {"deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}}


def _write_json(path: Path, value: dict, *, sort_keys: bool) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=sort_keys) + "\n")


def complete_target_config(folder: str | Path) -> None:
    """Add the keys of :data:`PUBLIC_CONFIG_KEYS` a target's ``config.json`` lacks (in transformers' style)."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    missing = {k: v for k, v in PUBLIC_CONFIG_KEYS.get(config.get("model_type"), {}).items() if k not in config}
    if missing:
        _write_json(path, {**config, **missing}, sort_keys=True)


def rewrite_draft_config(folder: str | Path) -> None:
    """Write an EAGLE3 draft's ``config.json`` back through ``Eagle3DraftConfig`` (as training saves it)."""
    path = Path(folder) / "config.json"
    config = Eagle3DraftConfig.from_dict(json.loads(path.read_text()))
    _write_json(path, config.to_dict(), sort_keys=True)


def record_target(folder: str | Path, target_folder: str | Path, **figures) -> None:
    """Name the target (its folder's name) and its weights' fingerprint in ``folder``'s ``training.json``,
    with ``figures`` (measured acceptance, say) added; the other entries keep their order."""
    path = Path(folder) / RECORD_FILE
    record = json.loads(path.read_text()) if path.is_file() else {}
    record.update(target=Path(target_folder).resolve().name, target_fingerprint=weights_fingerprint(target_folder),
                  **figures)
    _write_json(path, record, sort_keys=False)
