"""lm_eval against the server, as the seeds evaluate: ``lm_eval --model local-completions`` on two small
local tasks (lm_eval_tasks.py), with and without speculation: the scores and every per-sample output are
identical."""

from __future__ import annotations

from lm_eval_tasks import CHOICE, GENERATE, lm_eval, write_tasks


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
        assert plain_samples[task] == spec_samples[task]
        assert len(plain_samples[task]) == len(GENERATE if task == "specdec_gen" else CHOICE)
    # The generations stopped at lm_eval's stop strings; the loglikelihoods are finite numbers.
    assert all("\n\n" not in r[0][0] for _, r, _ in plain_samples["specdec_gen"])
    assert all(float(choice[0][0]) < 0 for _, resps, _ in plain_samples["specdec_choice"] for choice in resps)
    assert spec_server.metrics()["vllm:spec_decode_num_drafts_total"] > 0

