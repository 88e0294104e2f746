import json

import numpy as np
import pytest
import torch

from specdec.spec_stats import SpecStats


def test_hand_computed_two_steps():
    stats = SpecStats()
    # Step 1: three requests drafted 3, 3, 0 tokens; accepted 2, 0, 0. The third is not a draft.
    stats.observe([3, 3, 0], [2, 0, 0])
    # Step 2 (tensor input): two requests drafted 3 and 2; accepted 3 and 1.
    stats.observe(torch.tensor([3, 2]), torch.tensor([3, 1]))
    assert stats.num_drafts == 4
    assert stats.num_draft_tokens == 11
    assert stats.num_accepted_tokens == 6
    assert stats.accepted_per_position == [3, 2, 1]
    assert stats.acceptance_per_position == [0.75, 0.5, 0.25]
    assert stats.mean_acceptance_length == 2.5  # = 1 + 6/4 = 1 + sum of per-position rates
    assert stats.mean_acceptance_length == pytest.approx(1 + sum(stats.acceptance_per_position))
    assert stats.draft_acceptance_rate == pytest.approx(6 / 11)
    d = stats.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["accepted_per_position"] == [3, 2, 1] and d["mean_acceptance_length"] == 2.5


def test_empty_and_reset():
    stats = SpecStats.for_k(3)
    assert stats.as_dict() == {
        "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
        "accepted_per_position": [0, 0, 0], "acceptance_per_position": [0.0, 0.0, 0.0],
        "mean_acceptance_length": 1.0, "draft_acceptance_rate": 0.0, "num_drafts_histogram": [0, 0, 0, 0],
        "num_drafts_by_verifier": {}, "warnings": [],
    }
    stats.observe(np.array([0, 0]), np.array([0, 0]))  # no drafts: nothing counts
    assert stats.num_drafts == 0
    stats.observe([5], [4])  # grows past the preset length
    assert stats.accepted_per_position == [1, 1, 1, 1, 0]
    stats.count_chosen([3, 1, 0], [3, 3, 0])  # the third could not draft: not counted
    stats.count_chosen([0], [3])
    assert stats.num_drafts_histogram == [1, 1, 0, 1]
    stats.count_verified("coupled", 2)
    stats.count_verified("rejection", 0)  # nothing verified: no entry
    assert stats.num_drafts_by_verifier == {"coupled": 2}
    stats.warnings.append("acceptance collapsed")
    stats.reset()  # warnings are not counters: they stay
    assert stats == SpecStats(accepted_per_position=[0] * 5, num_drafts_histogram=[0] * 4,
                              warnings=["acceptance collapsed"])


def test_add_merges_positions_and_histograms():
    mine, theirs = SpecStats.for_k(2), SpecStats.for_k(4)
    mine.observe([2], [1])
    mine.count_chosen([2], [2])
    theirs.observe([4], [4])
    theirs.count_chosen([4, 0], [4, 4])
    mine.count_verified("coupled", 1)
    theirs.count_verified("coupled", 2)
    theirs.count_verified("rejection", 1)
    mine.warnings.append("a")
    theirs.warnings += ["a", "b"]
    mine.add(theirs)
    assert mine.num_drafts_by_verifier == {"coupled": 3, "rejection": 1} and mine.warnings == ["a", "b"]
    assert mine.accepted_per_position == [2, 1, 1, 1]
    assert mine.num_drafts_histogram == [1, 0, 1, 0, 1]
    assert mine.num_drafts == 2 and mine.num_accepted_tokens == 5


def test_bad_input():
    stats = SpecStats()
    with pytest.raises(ValueError, match="num_accepted <= num_drafts"):
        stats.observe([2], [3])
    with pytest.raises(ValueError, match="differ in length"):
        stats.observe([2, 1], [1])
    with pytest.raises(ValueError, match="ints"):
        stats.observe([2.5], [1])
    with pytest.raises(ValueError, match="num_drafts"):
        SpecStats(num_drafts=-1)
    with pytest.raises(ValueError, match="num_drafts_by_verifier"):
        SpecStats(num_drafts_by_verifier={"coupled": -1})
