"""lm_eval against the server, as the seeds evaluate: ``lm_eval --model local-completions`` on two small
local tasks (lm_eval_tasks.py), with and without speculation: the scores and every generation are
identical, and every loglikelihood to the last bits that batching moves (see below)."""

from __future__ import annotations

import pytest
from lm_eval_tasks import CHOICE, GENERATE, lm_eval, write_tasks


def _loglikelihoods(samples) -> list[float]:
    return [float(choice[0][0]) for _, resps, _ in samples for choice in resps]


def _flags(samples) -> list[str]:
    """Each choice's is-greedy flag."""
    return [choice[0][1] for _, resps, _ in samples for choice in resps]


def test_lm_eval_scores_and_samples_are_identical_with_and_without_speculation(
        plain_server, spec_server, llama, tmp_path):
    tasks = write_tasks(tmp_path)
    runs = {}
    for label, server in (("plain", plain_server), ("spec", spec_server)):
        (tmp_path / label).mkdir()
        runs[label] = lm_eval(llama, server.base, tasks, tmp_path, tmp_path / label / "out")
    (plain_results, plain_samples), (spec_results, spec_samples) = runs["plain"], runs["spec"]
    for task in tasks:
        assert plain_results["results"][task] == spec_results["results"][task]
        if task == "specdec_gen":
            assert plain_samples[task] == spec_samples[task]
        else:  # lm_eval's 8 concurrent requests batch differently on each run: a float64 row's last bit
            # depends on the rows beside it (batch invariance is issue 21), so loglikelihoods agree to 1e-12
            assert _loglikelihoods(plain_samples[task]) == pytest.approx(_loglikelihoods(spec_samples[task]), rel=1e-12)
            assert _flags(plain_samples[task]) == _flags(spec_samples[task])
        assert len(plain_samples[task]) == len(GENERATE if task == "specdec_gen" else CHOICE)
    # The generations stopped at lm_eval's stop strings; the loglikelihoods are finite numbers.
    assert all("\n\n" not in r[0][0] for _, r, _ in plain_samples["specdec_gen"])
    assert all(float(choice[0][0]) < 0 for _, resps, _ in plain_samples["specdec_choice"] for choice in resps)
    assert spec_server.metrics()["vllm:spec_decode_num_drafts_total"] > 0

