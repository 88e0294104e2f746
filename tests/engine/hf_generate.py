"""transformers' greedy generation, one prompt at a time (no padding), as the yardstick."""

from __future__ import annotations

from typing import Sequence

import torch


def hf_greedy(folder, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, ignore_eos: bool = False) -> list[list[int]]:
    """``generate(do_sample=False)`` in float64 for each prompt; the generated ids only."""
    from transformers import AutoModelForCausalLM

    kwargs = {"experts_implementation": "eager"}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **kwargs)
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if ignore_eos:
        gen.update(eos_token_id=None, min_new_tokens=max_new_tokens)
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
            outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs
