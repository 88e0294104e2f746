"""The n-gram (prompt lookup) proposer: draft the tokens that followed the latest earlier occurrence of
the request's suffix (``ngram_propose``), over each request's own tokens."""

from __future__ import annotations

from typing import Hashable, Sequence, Union

import attrs
import numpy as np
import torch

from specdec.proposers.base import Proposal, ProposerBase
from specdec.proposers.options import CommonOptions, keys_from, option
from specdec.validation import int_at_least

TokenSequence = Union[Sequence[int], np.ndarray, torch.Tensor]

_EMPTY = np.empty(0, dtype=np.int64)
# vLLM's choice: with neither bound given both are 5; with one given the other copies it.
NGRAM_DEFAULT_LOOKUP = 5

def _as_array(tokens: TokenSequence) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().cpu().reshape(-1).numpy()
    if isinstance(tokens, np.ndarray):
        return tokens.reshape(-1)
    # A list costs a conversion per call (about 0.1 ms at 4K); callers on the hot path should
    # keep each request's tokens in a numpy buffer.
    return np.asarray(tokens, dtype=np.int64)


def ngram_propose(tokens: TokenSequence, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Draft up to ``k`` tokens for a request whose tokens so far are ``tokens``.

    Finds the longest n-gram, ``max_n >= n >= min_n``, that ends the sequence and also occurs
    earlier in it (occurrences may overlap the suffix), takes its most recent earlier occurrence,
    and returns the up to ``k`` tokens that followed it (fewer when that occurrence is near the end).
    Returns an int64 array of 0..k ids; empty when no suffix of length >= ``min_n`` recurs.

    Cost: one vectorised comparison over the sequence for the last token, then each longer
    suffix only re-checks the positions that still match, so it is O(L) plus a few small steps.
    """
    if not (isinstance(k, int) and k >= 0):
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
        raise ValueError(f"need ints 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
    seq = _as_array(tokens)
    length = seq.shape[0]
    if k == 0 or length < min_n + 1:
        return _EMPTY
    # Ends e of earlier occurrences: e <= length - 2, so at least one token follows each.
    ends = np.flatnonzero(seq[: length - 1] == seq[length - 1])
    best_end = -1
    n = 1
    while ends.size:
        if n >= min_n:
            best_end = int(ends[-1])  # the most recent occurrence matching n tokens
        if n == max_n:
            break
        ends = ends[ends >= n]  # room for one more token before the occurrence
        ends = ends[seq[ends - n] == seq[length - 1 - n]]
        n += 1
    if best_end < 0:
        return _EMPTY
    # A copy, never a view: the caller keeps appending to (and may reuse) its token buffer.
    return seq[best_end + 1 : best_end + 1 + k].astype(np.int64)


@attrs.frozen(kw_only=True)
class NgramOptions(CommonOptions):
    """``ngram``'s keys: the common ones, and the shortest / longest suffix n-gram to look up.

    Defaults as vLLM: both 5, or the one given copied to the other.
    """

    prompt_lookup_min: int | None = option(int, int_at_least(1, optional=True))
    prompt_lookup_max: int | None = option(int, int_at_least(1, optional=True))

    def __attrs_post_init__(self) -> None:
        lo = self.prompt_lookup_min or self.prompt_lookup_max or NGRAM_DEFAULT_LOOKUP
        hi = self.prompt_lookup_max or self.prompt_lookup_min or NGRAM_DEFAULT_LOOKUP
        if lo > hi:
            raise ValueError(f"speculative config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        # Frozen class: filling defaults at construction is the one sanctioned mutation.
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)


@keys_from(NgramOptions)
class NgramProposer(ProposerBase):
    """Drafts the tokens that followed the latest earlier occurrence of the request's suffix.

    Keys: :class:`NgramOptions`. Deterministic (q is one-hot, ``draft_probs`` None), no KV pool, no
    model. Each request's tokens are mirrored in a growing numpy buffer, so a step copies only the new
    tokens instead of converting the whole list (``ngram_propose`` then runs on a view).
    """

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int | None = None, prompt_lookup_max: int | None = None
    ):
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._buffers: dict[Hashable, tuple[np.ndarray, int]] = {}

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
