"""What a draft's checkpoint records about how it was made, and the check that it fits the target loaded.

Drafts the project trains (:mod:`specdec.train`, ``scripts/build_zoo.py``) carry a ``training.json``
naming their target (``target``: its folder's name; ``target_fingerprint``: :func:`weights_fingerprint`
of its weights) and their greedy acceptance per position measured on held-out text
(``val_greedy_acceptance_per_position``: ``[[step, [a0, a1, ...]], ...]``, the last entry the final one).
:func:`check_target` compares the record with the target being served; the acceptance alarm
(:mod:`specdec.engine.acceptance_alarm`) compares the measured acceptance with the record's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import attrs

from specdec.models.loader import safetensors_files
from specdec.proposers.load_warnings import warn

RECORD_FILE = "training.json"
# Bytes hashed per tensor, from its start, middle and end: enough to tell two trainings apart (they
# differ in every weight) while reading a few KiB per tensor, however big the checkpoint.
_SAMPLE_BYTES = 4096


def weights_fingerprint(folder: str | Path) -> str:
    """A short hash of a checkpoint's weights, cheap to compute at load.

    It covers every tensor's name, dtype and shape in its safetensors headers and a few KiB of its
    bytes (start, middle and end). Two trainings, or a fine-tune, give different fingerprints; so does
    the same model saved in another dtype. It identifies weights; it does not check their integrity.
    """
    digest = hashlib.sha256()
    entries = []
    for file in safetensors_files(folder):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            base = 8 + size
            for name, info in header.items():
                if name != "__metadata__":
                    entries.append((name, info, file, base))
    handles: dict[Path, object] = {}
    try:
        for name, info, file, base in sorted(entries, key=lambda e: e[0]):
            digest.update(f"{name}|{info['dtype']}|{info['shape']}|".encode())
            f = handles.get(file) or handles.setdefault(file, open(file, "rb"))
            start, end = info["data_offsets"]
            for offset in _sample_offsets(start, end):
                f.seek(base + offset)
                digest.update(f.read(min(_SAMPLE_BYTES, end - offset)))
    finally:
        for f in handles.values():
            f.close()
    return digest.hexdigest()[:16]


def _sample_offsets(start: int, end: int) -> list[int]:
    if end - start <= 3 * _SAMPLE_BYTES:
        return list(range(start, end, _SAMPLE_BYTES))
    middle = start + (end - start) // 2
    return [start, middle, end - _SAMPLE_BYTES]


@attrs.frozen
class DraftRecord:
    """A draft's ``training.json``, as far as serving cares: its target and its measured acceptance.

    ``acceptance`` is the greedy acceptance per draft position (vLLM's definition) on held-out text,
    None when the record has none; ``target`` and ``target_fingerprint`` are None when unrecorded.
    """

    target: str | None = None
    target_fingerprint: str | None = None
    acceptance: tuple[float, ...] | None = None

    @classmethod
    def read(cls, folder: str | Path) -> "DraftRecord | None":
        """The record in ``folder/training.json``; None without one (or one that is not a JSON object)."""
        path = Path(folder) / RECORD_FILE
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(raw, dict):
            return None
        return cls(_text(raw.get("target")), _text(raw.get("target_fingerprint")),
                   _final_rates(raw.get("val_greedy_acceptance_per_position")))


def _text(value) -> str | None:
    return value if isinstance(value, str) and value else None


def _final_rates(curve) -> tuple[float, ...] | None:
    """The last ``[step, rates]`` entry's rates (or a plain list of rates), if they are rates."""
    if isinstance(curve, list) and curve and isinstance(curve[-1], list) and len(curve[-1]) == 2:
        curve = curve[-1][1]
    if isinstance(curve, list) and curve and all(isinstance(r, (int, float)) and 0 <= r <= 1 for r in curve):
        return tuple(float(r) for r in curve)
    return None


def check_target(draft_folder: str | Path, target_folder: str | Path, record: DraftRecord | None = None) -> None:
    """Warn (:func:`~specdec.proposers.load_warnings.warn`) when the draft's record names another target.

    With a recorded fingerprint the weights decide (a renamed copy of the right target is fine);
    without one, the target folder's name is compared with the recorded name.
    """
    record = record if record is not None else DraftRecord.read(draft_folder)
    if record is None or (record.target is None and record.target_fingerprint is None):
        return
    draft, target = str(draft_folder), Path(target_folder)
    named = f" ({record.target})" if record.target else ""
    if record.target_fingerprint is not None:
        found = weights_fingerprint(target)
        if found != record.target_fingerprint:
            warn(f"draft {draft!r} was trained for a target{named} with weights fingerprint "
                 f"{record.target_fingerprint}, but the target {str(target)!r} has {found}: it is another model "
                 "(or another copy of it: a fine-tune, another dtype), so acceptance may collapse")
    elif record.target != target.resolve().name:
        warn(f"draft {draft!r} was trained for target {record.target!r} ({RECORD_FILE}), but the target is "
             f"{str(target)!r}: acceptance may collapse if it is another model")
