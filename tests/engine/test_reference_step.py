"""The engine's speculative step, step by step, against the readable oracle (reference_step.py).

Batch 1, greedy, float64: the drafts the engine hands the target, how many it accepts and what it
emits must be what the oracle computes with transformers' models and no cache at all.
"""

from __future__ import annotations

import pytest
import torch

from reference_step import hf_greedy_draft, hf_target, speculative_decode
from specdec import LLM, SamplingParams
from specdec.outputs import trace_entries
from specdec.proposers.ngram import ngram_propose

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [9, 30, 31, 9, 30, 31, 9, 30, 31, 9], [100]]
K, MAX_TOKENS = 3, 14


def _engine_steps(llm: LLM, prompt: list[int]) -> list[dict]:
    steps = []
    llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False,
                 on_step=steps.append)
    # The oracle reports every step; the trace keeps steps that had drafts, so compare those.
    return [{k: e[k] for k in ("draft_token_ids", "num_accepted", "emitted_token_ids")} for e in trace_entries(steps)]


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ngram_steps_equal_the_oracle(prompt, tiny_checkpoint):
    folder = tiny_checkpoint("llama")
    llm = LLM(str(folder), dtype="float64", block_size=4, kv_cache_memory=1 << 22,
              speculative_config=f"ngram:num_speculative_tokens={K},prompt_lookup_min=1,prompt_lookup_max=3")
    drafts = lambda tokens, k: ngram_propose(tokens, k, 1, 3).tolist()  # noqa: E731
    want = [s for s in speculative_decode(hf_target(_hf(folder)), drafts, prompt, K, MAX_TOKENS) if s["draft_token_ids"]]
    assert _engine_steps(llm, prompt) == want


@pytest.mark.parametrize("prompt", PROMPTS)
def test_draft_model_steps_equal_the_oracle(prompt, tiny_checkpoint):
    folder, draft = tiny_checkpoint("llama"), tiny_checkpoint("llama_draft")
    llm = LLM(str(folder), dtype="float64", block_size=4, kv_cache_memory=1 << 22,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": K})
    want = speculative_decode(hf_target(_hf(folder)), hf_greedy_draft(_hf(draft)), prompt, K, MAX_TOKENS)
    assert _engine_steps(llm, prompt) == [s for s in want if s["draft_token_ids"]]
    assert sum(s["num_accepted"] for s in want) == llm.spec_stats().num_accepted_tokens
