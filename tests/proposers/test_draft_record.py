"""Draft records: every zoo draft names its target and that target's weights fingerprint, and serving
warns when the target loaded is another one."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open

from specdec.proposers.draft_record import DraftRecord, check_target, weights_fingerprint
from specdec.proposers.load_warnings import collecting
from specdec.zoo import ASSETS, ZOO_DIR, available

DRAFTS = [name for name in available() if ASSETS[name][0] != "target"]


@pytest.mark.parametrize("name", DRAFTS)
def test_every_zoo_draft_records_its_target_and_acceptance(name):
    record = DraftRecord.read(ZOO_DIR / name)
    target = ASSETS[name][1]
    assert record.target == target and record.target_fingerprint == weights_fingerprint(ZOO_DIR / target)
    assert len(record.acceptance) == 3 and 1 > record.acceptance[0] > record.acceptance[2] > 0


def test_the_fingerprint_follows_the_weights_not_the_folder(tmp_path):
    prints = {name: weights_fingerprint(ZOO_DIR / name) for name in ("llama-tiny", "kimi-k2-tiny", "minimax-m3-tiny")}
    assert len(set(prints.values())) == 3 and all(len(p) == 16 for p in prints.values())
    copy = shutil.copytree(ZOO_DIR / "llama-tiny", tmp_path / "renamed")
    assert weights_fingerprint(copy) == prints["llama-tiny"]
    # One weight changed: the first byte of a tensor's data (sampled, like its middle and end).
    file = copy / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        name = sorted(f.keys())[0]
    raw = bytearray(file.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    start = 8 + header + json.loads(raw[8 : 8 + header])[name]["data_offsets"][0]
    raw[start] ^= 0xFF
    file.write_bytes(bytes(raw))
    assert weights_fingerprint(copy) != prints["llama-tiny"]


def test_check_target_warns_for_another_target_only(tmp_path):
    with collecting() as found:
        check_target(ZOO_DIR / "llama-tiny-eagle3", ZOO_DIR / "llama-tiny")
        check_target(ZOO_DIR / "draft-model-tiny", ZOO_DIR / "llama-tiny")
    assert found == []
    with collecting() as found:
        check_target(ZOO_DIR / "kimi-k2-tiny-eagle3", ZOO_DIR / "llama-tiny")
    assert len(found) == 1
    assert "trained for a target (kimi-k2-tiny)" in found[0] and weights_fingerprint(ZOO_DIR / "llama-tiny") in found[0]
    # A record with a name only (an older training.json): the target folder's name is compared.
    (tmp_path / "training.json").write_text(json.dumps({"target": "kimi-k2-tiny"}))
    with collecting() as found:
        check_target(tmp_path, ZOO_DIR / "kimi-k2-tiny")
        check_target(tmp_path, ZOO_DIR / "llama-tiny")
    assert len(found) == 1 and "trained for target 'kimi-k2-tiny'" in found[0]


def test_record_reading(tmp_path):
    assert DraftRecord.read(tmp_path) is None
    (tmp_path / "training.json").write_text("not json")
    assert DraftRecord.read(tmp_path) is None
    (tmp_path / "training.json").write_text(json.dumps({"val_greedy_acceptance_per_position": [0.8, 0.5]}))
    assert DraftRecord.read(tmp_path) == DraftRecord(acceptance=(0.8, 0.5))
    curve = [[100, [0.5, 0.2]], [200, [0.7, 0.4]]]
    (tmp_path / "training.json").write_text(json.dumps({"target": "t", "val_greedy_acceptance_per_position": curve}))
    assert DraftRecord.read(tmp_path) == DraftRecord(target="t", acceptance=(0.7, 0.4))
