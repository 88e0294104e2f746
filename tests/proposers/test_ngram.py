import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.proposers.ngram import ngram_propose


def reference(tokens, k, min_n, max_n):
    """Brute force: longest n first, then the most recent earlier occurrence."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[length - n:] if n <= length else None
        for start in range(length - n - 1, -1, -1):  # start + n <= length - 1: a token follows
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    k=st.integers(0, 6),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 4),
)
def test_matches_brute_force(tokens, k, min_n, extra):
    max_n = min_n + extra
    got = ngram_propose(tokens, k, min_n, max_n)
    assert got.dtype == np.int64
    assert got.tolist() == reference(tokens, k, min_n, max_n)


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=40))
def test_input_types_agree(tokens):
    want = ngram_propose(tokens, 3, 1, 3).tolist()
    assert ngram_propose(np.array(tokens, dtype=np.int32), 3, 1, 3).tolist() == want
    assert ngram_propose(torch.tensor(tokens), 3, 1, 3).tolist() == want


def test_hand_cases():
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3], 3, 1, 3).tolist() == [4, 1, 2]
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3], 3, 4, 5).tolist() == []  # a 4-gram never recurs
    assert ngram_propose([7, 1, 2, 8, 1, 2, 9, 2], 2, 1, 3).tolist() == [9, 2]  # most recent "2"
    assert ngram_propose([5, 5, 5, 5], 3, 1, 3).tolist() == [5]  # overlapping, near the end
    assert ngram_propose([], 3, 1, 3).tolist() == []


def test_result_is_not_a_view_of_the_caller_buffer():
    buf = np.array([1, 2, 3, 1, 2], dtype=np.int64)
    out = ngram_propose(buf, 2, 1, 2)
    buf[:] = 0
    assert out.tolist() == [3, 1]


@pytest.mark.parametrize("args", [(-1, 1, 2), (2, 0, 2), (2, 3, 2), (2.0, 1, 2)])
def test_bad_arguments(args):
    with pytest.raises(ValueError):
        ngram_propose([1, 2, 1], *args)
