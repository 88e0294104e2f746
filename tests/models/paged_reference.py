"""Shared check for model tests: specdec over the paged cache versus transformers, in float64."""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from specdec.backends import get_backend
from specdec.cache import PagedKVCache
from specdec.runtime.model_runner import Chunk, ModelRunner, last_token_indices


@attrs.define
class GreedyTrace:
    tokens: list[list[int]]  # generated ids per prompt
    logits: list[list[torch.Tensor]]  # per prompt, per step: [V] logits that chose the token
    prefill_aux: list[torch.Tensor]  # per prompt: [prompt_len, n_aux * H] captured hidden states


def specdec_greedy(
    model,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    block_size: int = 16,
    aux_layer_ids: Sequence[int] = (),
    backend: str = "torch",
    memory: int = 1 << 26,
) -> GreedyTrace:
    """Batched ragged prefill then ``steps`` paged decode steps, all requests in every forward."""
    dtype = next(model.parameters()).dtype
    cache = PagedKVCache(memory)
    pools = [cache.register(p) for p in model.kv_pools("target", block_size, dtype)]
    cache.build()
    runner = ModelRunner(model, cache, get_backend(backend), [p.name for p in pools])
    chunks = [Chunk(i, list(p)) for i, p in enumerate(prompts)]
    trace = GreedyTrace([[] for _ in prompts], [[] for _ in prompts], [])
    out = runner.forward(chunks, aux_layer_ids)
    if aux_layer_ids:
        trace.prefill_aux = list(torch.split(out.aux_hidden_states, [len(p) for p in prompts]))
    logits = model.compute_logits(out.hidden_states[last_token_indices(chunks)])
    for _ in range(steps):
        next_ids = logits.argmax(-1).tolist()
        for i, tok in enumerate(next_ids):
            trace.tokens[i].append(tok)
            trace.logits[i].append(logits[i])
        chunks = [Chunk(i, [tok]) for i, tok in enumerate(next_ids)]
        out = runner.forward(chunks)
        logits = model.compute_logits(out.hidden_states)
    return trace


def transformers_greedy(hf_model, prompts: Sequence[Sequence[int]], steps: int, aux_layer_ids=()) -> GreedyTrace:
    """The same, one prompt at a time with full recomputation (no cache, no padding)."""
    trace = GreedyTrace([[] for _ in prompts], [[] for _ in prompts], [])
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = list(prompt)
            for step in range(steps):
                out = hf_model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
                if step == 0 and aux_layer_ids:
                    trace.prefill_aux.append(torch.cat([out.hidden_states[j][0] for j in aux_layer_ids], dim=-1))
                row = out.logits[0, -1]
                tok = int(row.argmax())
                trace.tokens[i].append(tok)
                trace.logits[i].append(row)
                ids.append(tok)
    return trace


def assert_traces_match(ours: GreedyTrace, ref: GreedyTrace, rtol: float = 1e-6) -> None:
    assert ours.tokens == ref.tokens
    for mine, theirs in zip(ours.logits, ref.logits):
        for a, b in zip(mine, theirs):
            scale = b.abs().max().clamp_min(1e-12)
            assert ((a - b).abs().max() / scale) < rtol
    for a, b in zip(ours.prefill_aux, ref.prefill_aux):
        scale = b.abs().max().clamp_min(1e-12)
        assert ((a - b).abs().max() / scale) < rtol
