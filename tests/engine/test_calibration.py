"""The adaptive controller's starting curves: the target's and the draft chain's forwards timed when
the engine starts."""

from __future__ import annotations

import pytest

from specdec import LLM
from specdec.engine.calibration import CALIBRATION_MAX_ROWS, calibration_layouts, calibration_sizes
from specdec.zoo import zoo_path


@pytest.mark.parametrize("max_num_seqs, layouts", [
    (1, [(1, 1), (1, 2), (1, 3), (1, 4)]),
    (3, [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 4), (3, 1), (3, 4)]),
])
def test_calibration_times_every_step_a_lone_request_runs_and_both_ends_of_each_load(max_num_seqs, layouts):
    # k=3: one request steps at 1 to 4 rows; n requests at n rows (no drafts) to 4n (every draft).
    llm = LLM(str(zoo_path("llama-tiny")), dtype="float32", kv_cache_memory=1 << 22, max_num_seqs=max_num_seqs,
              speculative_config={"method": "eagle3", "model": str(zoo_path("llama-tiny-eagle3")),
                                  "num_speculative_tokens": 3, "adaptive": True})
    calibrated = llm.engine.draft_counts.target_seconds.calibrated
    assert sorted(calibrated) == sorted((n * length, n) for n, length in layouts)
    assert all(seconds > 0 for seconds in calibrated.values())
    assert calibration_layouts(3, max_num_seqs, 4 * max_num_seqs) == layouts
    assert calibration_sizes(5, 6) == [1, 2, 3, 4, 5, 6]
    assert calibration_sizes(3, 1000) == [1, 2, 3, 4, 8, 16, 32, 64, 128, CALIBRATION_MAX_ROWS]
    # No layout past CALIBRATION_MAX_ROWS rows: 128 requests' drafts (512 rows) extrapolate.
    assert calibration_layouts(3, 128, 512)[-4:] == [(32, 4), (64, 1), (64, 4), (128, 1)]


DRAFTS = {
    "eagle3": ("llama-tiny", {"model": "llama-tiny-eagle3"}),
    "eagle3-unshifted": ("llama-tiny", {"model": "llama-tiny-eagle3-unshifted", "kv_sharing": True}),
    "eagle3.1-mla": ("kimi-k2-tiny", {"model": "kimi-k2-tiny-eagle3.1-mla"}),
    "draft_model": ("llama-tiny", {"model": "draft-model-tiny"}),
    "ngram": ("llama-tiny", {"prompt_lookup_min": 1, "prompt_lookup_max": 3}),
}


@pytest.mark.parametrize("method", sorted(DRAFTS))
def test_calibration_times_a_draft_chain_step_by_requests_and_the_keeping_borrows_its_shape(method):
    target, keys = DRAFTS[method]
    keys = {key: str(zoo_path(value)) if key == "model" else value for key, value in keys.items()}
    llm = LLM(str(zoo_path(target)), dtype="float32", kv_cache_memory=1 << 22, max_num_seqs=5,
              speculative_config={"method": method, **keys, "num_speculative_tokens": 3, "adaptive": True})
    controller, cache = llm.engine.draft_counts, llm.engine.cache
    draft, keep = controller.draft_seconds, controller.keep_seconds
    if method == "ngram":  # no forward of its own to time
        assert draft.calibrated == keep.calibrated == {}
    else:
        assert sorted(draft.calibrated) == calibration_sizes(3, 5) == [1, 2, 3, 4, 5]
        assert all(seconds > 0 for seconds in draft.calibrated.values())
        assert draft(5) > 0 and keep.calibrated == draft.calibrated
    assert keep(5) == 0.0  # the draft's costs give keeping a shape, not a price, until a step keeps state
    for name, pool in cache.pools.items():  # the throwaway requests gave every page back
        assert cache.num_free_blocks(name) == pool.num_blocks
