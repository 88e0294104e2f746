"""The n-gram (prompt lookup) proposer: ``ngram_propose`` over each request's own tokens."""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from specdec.proposers.base import Proposal, ProposerBase
from specdec.proposers.ngram import ngram_propose


class NgramProposer(ProposerBase):
    """Drafts the tokens that followed the latest earlier occurrence of the request's suffix.

    Deterministic (q is one-hot, ``draft_probs`` None), no KV pool, no model. Each request's
    tokens are mirrored in a growing numpy buffer, so a step copies only the new tokens instead of
    converting the whole list (``ngram_propose`` then runs on a view).
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 5, prompt_lookup_max: int = 5):
        if not (isinstance(num_speculative_tokens, int) and num_speculative_tokens >= 1):
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {num_speculative_tokens!r}")
        if not (1 <= prompt_lookup_min <= prompt_lookup_max):
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._buffers: dict[Hashable, tuple[np.ndarray, int]] = {}

    @classmethod
    def from_config(cls, config) -> "NgramProposer":
        return cls(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, seqs: Sequence, max_drafts: Sequence[int]) -> Proposal:
        drafts: list[list[int]] = []
        for seq, limit in zip(seqs, max_drafts):
            if limit <= 0:
                drafts.append([])
                continue
            tokens = self._tokens(seq.seq_id, seq.token_ids)
            drafts.append(ngram_propose(tokens, limit, self.min_n, self.max_n).tolist())
        return Proposal(drafts)

    def free(self, request: Hashable) -> None:
        self._buffers.pop(request, None)

    def _tokens(self, key: Hashable, token_ids: list[int]) -> np.ndarray:
        # Tokens are only ever appended to a request, so the buffer's prefix stays valid.
        buf, n = self._buffers.get(key, (None, 0))
        total = len(token_ids)
        if buf is None or buf.shape[0] < total:
            grown = np.empty(max(2 * total, 64), dtype=np.int64)
            if buf is not None:
                grown[:n] = buf[:n]
            buf = grown
        if n < total:
            buf[n:total] = token_ids[n:total]
        self._buffers[key] = (buf, total)
        return buf[:total]
