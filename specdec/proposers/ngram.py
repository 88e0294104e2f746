"""Prompt lookup: draft the tokens that followed the last occurrence of the current suffix."""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch

TokenSequence = Union[Sequence[int], np.ndarray, torch.Tensor]

_EMPTY = np.empty(0, dtype=np.int64)


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
