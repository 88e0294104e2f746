import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.proposers.ngram import ngram_propose, suffix_match_ends


def reference(tokens, k, min_n, max_n):
    """Brute force: longest n first, then the most recent earlier occurrence; the text after it is
    copied one token at a time onto the end, so the copy runs on into its own output."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[length - n:] if n <= length else None
        for start in range(length - n - 1, -1, -1):  # start + n <= length - 1: a token follows
            if tokens[start:start + n] == suffix:
                text = list(tokens)
                for i in range(k):
                    text.append(text[start + n + i])
                return text[length:]
    return []


def reference_ends(tokens, min_n, max_n):
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        ends = [s + n - 1 for s in range(length - n) if tokens[s:s + n] == tokens[length - n:]]
        if ends:
            return ends
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
    assert len(got) in (0, k)  # a match always drafts in full
    ends = suffix_match_ends(tokens, min_n, max_n)
    assert ends.dtype == np.int64
    assert ends.tolist() == reference_ends(tokens, min_n, max_n)


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=40))
def test_input_types_agree(tokens):
    want = ngram_propose(tokens, 3, 1, 3).tolist()
    assert ngram_propose(np.array(tokens, dtype=np.int32), 3, 1, 3).tolist() == want
    assert ngram_propose(torch.tensor(tokens), 3, 1, 3).tolist() == want


def test_hand_cases():
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3], 3, 1, 3).tolist() == [4, 1, 2]
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3], 3, 4, 5).tolist() == []  # a 4-gram never recurs
    assert ngram_propose([1, 2, 3], 3, 1, 3).tolist() == []  # nothing recurs
    assert ngram_propose([1, 2, 1], 0, 1, 3).tolist() == []
    assert ngram_propose([], 3, 1, 3).tolist() == []


def test_the_most_recent_of_equal_matches_wins():
    # "1" is followed by 9, 9, then 8: the most recent occurrence's 8, not the most frequent 9.
    assert ngram_propose([1, 9, 1, 9, 1, 8, 1], 1, 1, 1).tolist() == [8]
    assert ngram_propose([7, 1, 2, 8, 1, 2, 9, 2], 2, 1, 1).tolist() == [9, 2]
    # Not the earliest either (vLLM's rule would draft 5, 6).
    assert ngram_propose([3, 5, 6, 3, 4, 6, 3], 2, 1, 1).tolist() == [4, 6]


def test_a_longer_match_beats_a_more_recent_one():
    # "2" last occurred before 6, but "1 2" (two tokens) only before 5.
    assert ngram_propose([1, 2, 5, 3, 2, 6, 1, 2], 1, 1, 2).tolist() == [5]
    assert ngram_propose([1, 2, 5, 3, 2, 6, 1, 2], 1, 1, 1).tolist() == [6]  # max_n caps the match
    assert ngram_propose([4, 1, 2, 5, 3, 2, 6, 1, 2], 2, 2, 2).tolist() == [5, 3]


def test_matches_near_the_end_repeat_into_the_draft():
    # The match "1 2 3" ends 3 tokens back: after 1 2 3 the text repeats with period 3.
    assert ngram_propose([9, 1, 2, 3, 1, 2, 3], 5, 1, 3).tolist() == [1, 2, 3, 1, 2]
    # The match ends right before the last token: period 1.
    assert ngram_propose([4, 7, 7], 3, 1, 2).tolist() == [7, 7, 7]
    assert ngram_propose([5, 5, 5, 5], 3, 1, 3).tolist() == [5, 5, 5]  # overlapping match "5 5 5"
    # Period 2 ("a b a b"), and a full continuation when the text after the match is long enough.
    assert ngram_propose([1, 2, 1, 2], 5, 1, 2).tolist() == [1, 2, 1, 2, 1]
    assert ngram_propose([1, 2, 3, 4, 5, 1, 2], 3, 1, 2).tolist() == [3, 4, 5]
    assert ngram_propose([1, 2, 3, 4, 5, 1, 2], 7, 1, 2).tolist() == [3, 4, 5, 1, 2, 3, 4]


def test_suffix_match_ends():
    assert suffix_match_ends([1, 2, 1, 2, 1, 2], 1, 2).tolist() == [1, 3]  # "1 2", overlaps allowed
    assert suffix_match_ends([1, 2, 1, 2, 1, 2], 1, 3).tolist() == [3]  # "2 1 2"
    assert suffix_match_ends([1, 2, 1, 2, 1, 2], 1, 5).tolist() == [3]  # "2 1 2 1 2" ends at 4 at most
    assert suffix_match_ends([1, 2, 3], 1, 3).tolist() == []
    assert suffix_match_ends([1, 2, 3, 2], 2, 3).tolist() == []  # "2" recurs, but min_n is 2
    assert suffix_match_ends([], 1, 3).tolist() == []


def test_result_is_not_a_view_of_the_caller_buffer():
    buf = np.array([1, 2, 3, 1, 2], dtype=np.int64)
    out = ngram_propose(buf, 2, 1, 2)
    buf[:] = 0
    assert out.tolist() == [3, 1]


@pytest.mark.parametrize("args", [(-1, 1, 2), (2, 0, 2), (2, 3, 2), (2.0, 1, 2)])
def test_bad_arguments(args):
    with pytest.raises(ValueError):
        ngram_propose([1, 2, 1], *args)
