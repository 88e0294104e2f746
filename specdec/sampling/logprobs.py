"""Log-probabilities of chosen tokens and of the most likely alternatives, from raw logits rows."""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.outputs import TokenLogprob
from specdec.sampling.processing import work_dtype


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """For row ``i`` of ``logits [n, V]``: the log-probability of ``token_ids[i]`` under the softmax of
    the row (the model's unprocessed distribution), and the ``num_top`` most likely tokens."""
    logp = torch.log_softmax(logits.to(work_dtype(logits.dtype)), dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logp.device).view(-1, 1)).view(-1).tolist()
    if num_top:
        values, ids = logp.topk(num_top, dim=-1)
        tops = [tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops)]


def new_token_logprobs(seq, new: Sequence[int], rows: torch.Tensor) -> tuple[TokenLogprob, ...] | None:
    """Logprobs of a step's ``new`` tokens of ``seq``, when it asked for them (``rows``: the logits from
    the request's first verify row on)."""
    if seq.params.logprobs is None or not new:
        return None
    return tuple(token_logprobs(rows[: len(new)], new, seq.params.logprobs))


def prompt_logprobs(model, seq, layout, i: int, output) -> tuple[TokenLogprob, ...] | None:
    """Logprobs of ``seq``'s prompt tokens 1.., when the step (request ``i`` of ``layout``, hidden states in
    ``output``) computed its whole prompt and the request asked for them."""
    prompt = seq.num_prompt_tokens
    if seq.params.prompt_logprobs is None or layout.start_positions[i] != 0 or prompt < 2:
        return None
    start = layout.row_starts[i]
    logits = model.compute_logits(output.hidden_states[start : start + prompt - 1])
    return tuple(token_logprobs(logits, seq.token_ids[1:prompt], seq.params.prompt_logprobs))
