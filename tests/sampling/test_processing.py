import math

import pytest
import torch

from specdec.sampling import greedy_ids, target_probs


def reference_probs(logits, temperature, top_k, top_p):
    """Row-by-row brute force in Python floats, written independently of the vectorised code."""
    vocab = len(logits)
    if temperature == 0:
        best = max(range(vocab), key=lambda v: (logits[v], -v))
        return [1.0 if v == best else 0.0 for v in range(vocab)]
    x = [v / temperature for v in logits]
    keep = set(range(vocab))
    if 0 < top_k < vocab:
        kth = sorted(x, reverse=True)[top_k - 1]
        keep = {v for v in keep if x[v] >= kth}
    m = max(x[v] for v in keep)
    w = {v: math.exp(x[v] - m) for v in keep}
    z = sum(w.values())
    p = {v: w[v] / z for v in keep}
    if top_p < 1:
        nucleus, mass = set(), 0.0
        for v in sorted(keep, key=lambda v: (-x[v], v)):
            if mass >= top_p:
                break
            nucleus.add(v)
            mass += p[v]
        z = sum(p[v] for v in nucleus)
        p = {v: p[v] / z for v in nucleus}
    return [p.get(v, 0.0) for v in range(vocab)]


def test_matches_reference_per_row_params():
    gen = torch.Generator().manual_seed(0)
    n, vocab = 64, 23
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 3
    temperature = torch.tensor([[0.0, 0.3, 1.0, 2.5][i % 4] for i in range(n)], dtype=torch.float64)
    top_k = torch.tensor([[0, 1, 5, 22, 23, 40][i % 6] for i in range(n)])
    top_p = torch.tensor([[1.0, 0.9, 0.5, 0.05, 0.999][i % 5] for i in range(n)], dtype=torch.float64)
    got = target_probs(logits, temperature, top_k, top_p)
    assert got.dtype == torch.float64
    want = torch.tensor(
        [reference_probs(logits[i].tolist(), temperature[i].item(), top_k[i].item(), top_p[i].item()) for i in range(n)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.sum(-1), torch.ones(n, dtype=torch.float64))


def test_hand_computed_nucleus_and_top_k_ties():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]] * 3, dtype=torch.float64)
    ones = torch.ones(3, dtype=torch.float64)
    got = target_probs(logits, ones, torch.zeros(3, dtype=torch.int64), torch.tensor([0.6, 0.5, 0.81], dtype=torch.float64))
    want = torch.tensor([[0.625, 0.375, 0.0], [1.0, 0.0, 0.0], [0.5, 0.3, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(got, want)
    tied = torch.tensor([[2.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    got = target_probs(tied, ones[:1], torch.tensor([2]), ones[:1])
    assert (got[0, :3] > 0).all() and got[0, 3] == 0  # both tokens tied with the 2nd are kept


def test_greedy_rows_are_one_hot_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, -1.0], [0.0, 0.0, 0.0, 5.0]])
    got = target_probs(logits, torch.zeros(2, dtype=torch.float64), torch.tensor([1, 0]), torch.tensor([0.1, 1.0], dtype=torch.float64))
    assert got.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]


def test_top_p_one_keeps_the_tail_in_float32():
    # The float32 cumulative sum reaches 1.0 long before the tail; top_p == 1 must drop nothing.
    logits = torch.cat([torch.tensor([0.0]), torch.full((999,), -30.0)]).unsqueeze(0)
    got = target_probs(logits, torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.float64))
    assert got.dtype == torch.float32 and bool((got > 0).all())


def test_low_precision_is_lifted_to_float32():
    logits = torch.randn(2, 7).to(torch.bfloat16)
    got = target_probs(logits, torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.float64))
    assert got.dtype == torch.float32


def test_shape_errors_are_named():
    with pytest.raises(ValueError, match="temperature"):
        target_probs(torch.zeros(3, 5), torch.ones(2), torch.zeros(3, dtype=torch.int64), torch.ones(3))
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        target_probs(torch.zeros(5), torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_greedy_ids_is_the_argmax_first_on_ties(dtype):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4)).to(dtype)
    logits[1, 17] = logits[1, 250] = logits[1].max() + 1  # a tie: the first index wins
    ids = greedy_ids(logits)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, logits.argmax(dim=-1)) and int(ids[1]) == 17
