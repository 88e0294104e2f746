"""Load-time warnings for EAGLE3 drafts that load but cannot draft well: an embedding of another target,
and SpecForge <= 0.2.0's ignored ``norm_output``. Warnings, never errors: the draft still loads."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_reference import DraftSpec, draft_config, make_weights, save_llama_target, write_draft

from specdec.models import load_model
from specdec.proposers.eagle3 import Eagle3DraftConfig, load_eagle3_draft
from specdec.proposers.load_warnings import collecting


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_target")
    save_llama_target(folder)
    return load_model(folder, dtype="float64")


def warnings_of(folder, target) -> list[str]:
    with collecting() as found:
        load_eagle3_draft(folder, target)
    return found


def test_an_embedding_of_another_target_is_warned_about(target, tmp_path):
    spec = DraftSpec(own_embed=True, flags_in_eagle_config=True)
    weights = make_weights(spec)
    found = warnings_of(write_draft(tmp_path / "other", spec, weights), target)
    assert len(found) == 1 and "ships its own embed_tokens" in found[0] and "another target" in found[0]
    # The target's own rows, as SpecForge's export ships them (in bf16: a copy survives rounding).
    weights["embed_tokens.weight"] = target.embed(torch.arange(64)).to(torch.bfloat16).double()
    assert warnings_of(write_draft(tmp_path / "copy", spec, weights), target) == []


@pytest.mark.parametrize("norm_output", [True, False])
def test_specforge_norm_output_hazard(target, tmp_path, norm_output):
    spec = DraftSpec(norm_output=norm_output)
    config = draft_config(spec)
    config["norm_output"] = norm_output  # SpecForge's spelling: at the top level of a LlamaForCausalLMEagle3
    folder = write_draft(tmp_path / "specforge", spec, make_weights(spec), config=config)
    found = warnings_of(folder, target)
    assert len(found) == 1 and "SpecForge up to 0.2.0" in found[0] and "PR #879" in found[0]
    assert ("set norm_output: false" in found[0]) == norm_output
    # Written by this project (both spellings, or a training record of its own): no warning.
    both = dict(config, eagle_config={**config["eagle_config"], "norm_output": norm_output})
    assert warnings_of(write_draft(tmp_path / "both", spec, make_weights(spec), config=both), target) == []
    (folder / "training.json").write_text("{}")
    assert warnings_of(folder, target) == []


def test_the_31_flags_are_read_in_either_place_and_written_in_both():
    for in_eagle_config in (False, True):
        spec = DraftSpec(fc_norm=True, norm_output=True, flags_in_eagle_config=in_eagle_config)
        config = Eagle3DraftConfig.from_dict(draft_config(spec))
        assert config.fc_norm and config.norm_output
        written = config.to_dict()
        for flag in ("fc_norm", "norm_output"):
            assert written[flag] is True and written["eagle_config"][flag] is True
        assert Eagle3DraftConfig.from_dict(written) == config
    from specdec.zoo import zoo_path

    raw = json.loads((zoo_path("kimi-k2-tiny-eagle3.1-mla") / "config.json").read_text())
    assert raw["fc_norm"] is raw["norm_output"] is raw["eagle_config"]["norm_output"] is True
