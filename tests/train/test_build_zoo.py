"""scripts/build_zoo.py end to end on test-sized presets: every asset loads, and a rebuild is byte-identical."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from specdec.models import load_model
from specdec.proposers.draft_record import DraftRecord, weights_fingerprint
from specdec.proposers.eagle3 import load_eagle3_draft
from specdec.zoo import ASSETS, available, zoo_path

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_zoo.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("build_zoo", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLAN = {
    "t-llama": ("target", None, "test-llama"),
    "t-kimi": ("target", None, "test-kimi-k2"),
    "t-llama-eagle3": ("eagle3", "t-llama", "test-eagle3"),
    "t-kimi-mla": ("eagle3.1-mla", "t-kimi", "test-eagle3.1-mla"),
}


def test_build_is_deterministic_and_every_asset_loads(tmp_path, small_corpus):
    build_zoo = _load_script()
    kwargs = dict(seed=0, quick=True, progress=False, corpus=small_corpus, vocab_size=400)
    first, _ = build_zoo.build_assets(tmp_path / "a", PLAN, **kwargs)
    second, _ = build_zoo.build_assets(tmp_path / "b", PLAN, **kwargs)
    assert first["assets"] == second["assets"]  # same files, same hashes
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["total_bytes"] == first["total_bytes"]
    for name in ("t-llama", "t-kimi"):
        load_model(tmp_path / "a" / name)
    target = load_model(tmp_path / "a" / "t-kimi")
    load_eagle3_draft(tmp_path / "a" / "t-kimi-mla", target, method="eagle3.1-mla")
    load_eagle3_draft(tmp_path / "a" / "t-llama-eagle3", load_model(tmp_path / "a" / "t-llama"))
    # The layouts public engines read, and each draft's record of its target.
    config = json.loads((tmp_path / "a" / "t-kimi" / "config.json").read_text())
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    draft_config = json.loads((tmp_path / "a" / "t-kimi-mla" / "config.json").read_text())
    assert draft_config["norm_output"] is draft_config["eagle_config"]["norm_output"] is True
    for draft, target in (("t-kimi-mla", "t-kimi"), ("t-llama-eagle3", "t-llama")):
        record = DraftRecord.read(tmp_path / "a" / draft)
        assert record.target == target and record.target_fingerprint == weights_fingerprint(tmp_path / "a" / target)


def test_the_zoo_is_finished(tmp_path):
    """What --refresh applies to built assets is already in the shipped zoo (the draft_model's measured
    acceptance aside: test_draft_record checks that it is recorded)."""
    build_zoo = _load_script()
    for name in ("kimi-k2-tiny", "kimi-k2-tiny-eagle3.1-mla", "llama-tiny-eagle3"):
        shutil.copytree(zoo_path(name), tmp_path / name)
    shutil.copytree(zoo_path("llama-tiny"), tmp_path / "llama-tiny", ignore=shutil.ignore_patterns("*.json"))
    for name in ("kimi-k2-tiny", "kimi-k2-tiny-eagle3.1-mla", "llama-tiny-eagle3"):
        kind, target = ASSETS[name]
        build_zoo.finish_asset(tmp_path / name, kind, tmp_path / target if target else None)
        for file in (tmp_path / name).iterdir():
            assert file.read_bytes() == (zoo_path(name) / file.name).read_bytes(), (name, file.name)


def test_a_draft_without_its_target_is_refused(tmp_path, small_corpus):
    build_zoo = _load_script()
    with pytest.raises(FileNotFoundError, match="needs its target"):
        build_zoo.build_assets(tmp_path, {"d": ("eagle3", "missing", "test-eagle3")}, corpus=small_corpus,
                               vocab_size=400, progress=False)


def test_zoo_paths():
    assert set(ASSETS) >= {"minimax-m3-tiny", "minimax-m3-tiny-eagle3", "kimi-k2-tiny-eagle3.1-mla",
                           "llama-tiny-eagle3-unshifted", "draft-model-tiny"}
    with pytest.raises(ValueError, match="unknown zoo asset"):
        zoo_path("nope")
    for name in set(ASSETS) - set(available()):
        with pytest.raises(FileNotFoundError, match="build_zoo.py"):
            zoo_path(name)
    for name in available():
        assert (zoo_path(name) / "config.json").is_file()
