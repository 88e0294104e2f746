"""The adaptive draft controller under tensor parallelism: every rank must choose the same draft counts
(a rank drafting otherwise would issue other collectives and hang the group), although each times its
own steps; the ranks take the driver's timings with each step's message. Two ranks with ``adaptive``
give the one-rank plain output, float64 greedy, and choose like each other (the run completes, and
the workers' token digest never differs from the driver's)."""

from __future__ import annotations

from specdec import LLM, SamplingParams
from specdec.zoo import zoo_path


def test_two_ranks_choose_alike_and_equal_plain_output():
    target, draft = str(zoo_path("llama-tiny")), str(zoo_path("llama-tiny-eagle3"))
    prompts = [[11, 12, 13, 14, 15, 16], [200, 201, 202], [7] * 12, [300, 301, 302, 303], [5, 6]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLM(target, dtype="float64", kv_cache_memory=1 << 22)
    expected = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 3, "adaptive": True}
    llm = LLM(target, dtype="float64", kv_cache_memory=1 << 22, speculative_config=spec, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        assert sum(llm.spec_stats().num_drafts_histogram) > 0
    finally:
        llm.close()
