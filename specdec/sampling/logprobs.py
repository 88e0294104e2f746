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
