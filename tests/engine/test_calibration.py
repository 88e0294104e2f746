"""The adaptive controller's starting target curve: the forwards timed when the engine starts."""

from __future__ import annotations

import pytest

from specdec import LLM
from specdec.engine.calibration import CALIBRATION_MAX_ROWS, calibration_sizes
from specdec.zoo import zoo_path


@pytest.mark.parametrize("max_num_seqs, sizes", [(1, [1, 2, 3, 4]), (3, [1, 2, 3, 4, 8, 12])])
def test_calibration_times_every_size_a_lone_request_steps_at_and_the_largest_step(max_num_seqs, sizes):
    # k=3: one request steps at 1 to 4 rows; three requests of 4 rows are the largest decode step (12).
    llm = LLM(str(zoo_path("llama-tiny")), dtype="float32", kv_cache_memory=1 << 22, max_num_seqs=max_num_seqs,
              speculative_config={"method": "eagle3", "model": str(zoo_path("llama-tiny-eagle3")),
                                  "num_speculative_tokens": 3, "adaptive": True})
    calibrated = llm.engine.draft_counts.target_seconds.calibrated
    assert sorted(calibrated) == sizes and all(seconds > 0 for seconds in calibrated.values())
    assert calibration_sizes(5, 6) == [1, 2, 3, 4, 5, 6]
    assert calibration_sizes(3, 1000) == [1, 2, 3, 4, 8, 16, 32, 64, 128, CALIBRATION_MAX_ROWS]
