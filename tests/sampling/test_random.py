import random

import pytest
import torch
from scipy import stats

from specdec.sampling import categorical, uniform
from specdec.sampling.random import HOST_MAX_ROWS, STREAM_DRAFT, mix64, to_int64_seed

M64 = (1 << 64) - 1


def splitmix_output(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_mix64_is_splitmix64_with_wrapping_int64_arithmetic():
    rng = random.Random(0)
    words = [rng.getrandbits(64) for _ in range(2000)] + [0, 1, M64, 1 << 63]
    got = mix64(torch.tensor([to_int64_seed(w) for w in words], dtype=torch.int64)).tolist()
    assert [g & M64 for g in got] == [splitmix_output(w) for w in words]


def test_uniform_is_a_pure_function_inside_the_open_interval():
    seeds = torch.tensor([0, 1, 0, 0, -5], dtype=torch.int64)
    counters = torch.tensor([0, 0, 1, 0, 7], dtype=torch.int64)
    a = uniform(seeds, counters, 0, 8)
    assert a.dtype == torch.float64 and a.shape == (5, 8)
    assert torch.equal(a, uniform(seeds, counters, 0, 8))
    assert torch.equal(a[:, :3], uniform(seeds, counters, 0, 3))  # columns do not depend on width
    assert torch.equal(a[[4, 1]], uniform(seeds[[4, 1]], counters[[4, 1]], 0, 8))  # nor on other rows
    assert torch.equal(a[0], a[3])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert not torch.equal(a, uniform(seeds, counters, 1, 8))  # streams differ
    per_row = uniform(seeds, counters, torch.tensor([0, 1, 0, 1, 0]), 8)
    assert torch.equal(per_row[[0, 2, 4]], a[[0, 2, 4]]) and not torch.equal(per_row[1], a[1])
    big = uniform(torch.arange(200), torch.zeros(200, dtype=torch.int64), 2, 500)
    assert bool((big > 0).all()) and bool((big < 1).all())


@pytest.mark.parametrize("rows", [1, 5, HOST_MAX_ROWS])
def test_a_few_rows_uniforms_on_the_host_equal_the_tensor_arithmetic(rows):
    # One column of a few CPU rows is computed on Python ints; a second column forces the tensor ops,
    # and a column does not depend on the width.
    rng = random.Random(rows)
    extremes = [-(1 << 63), (1 << 63) - 1, 0, -1]
    seeds = torch.tensor((extremes + [rng.randrange(-(1 << 63), 1 << 63) for _ in range(rows)])[:rows])
    counters = torch.tensor([rng.randrange(1 << 40) for _ in range(rows)])
    for stream in (0, STREAM_DRAFT, torch.tensor(STREAM_DRAFT), torch.randint(0, 4, (rows,))):
        assert torch.equal(uniform(seeds, counters, stream, 1), uniform(seeds, counters, stream, 2)[:, :1])


@pytest.mark.parametrize("vary", ["seed", "counter", "column"])
def test_uniform_passes_kolmogorov_smirnov(vary):
    n = 20000
    idx = torch.arange(n, dtype=torch.int64)
    zero = torch.zeros(n, dtype=torch.int64)
    if vary == "seed":
        u = uniform(idx, zero + 3, 0, 1)[:, 0]
    elif vary == "counter":
        u = uniform(zero + 11, idx, 0, 1)[:, 0]
    else:
        u = uniform(zero[:1], zero[:1], 0, n)[0]
    assert stats.kstest(u.numpy(), "uniform").pvalue > 0.001
    # Neighbouring values are uncorrelated.
    assert abs(stats.pearsonr(u[:-1].numpy(), u[1:].numpy())[0]) < 0.05


def test_categorical_law_and_zero_mass():
    n = 30000
    probs = torch.tensor([[0.1, 0.0, 0.25, 0.6, 0.0, 0.05]], dtype=torch.float64).expand(n, -1)
    draws = categorical(probs * 7.0, torch.arange(n), torch.zeros(n, dtype=torch.int64), 0)  # unnormalised
    counts = torch.bincount(draws, minlength=6)
    assert counts[1] == 0 and counts[4] == 0
    keep = [0, 2, 3, 5]
    expected = probs[0, keep] * n
    assert stats.chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 0.001


def test_categorical_one_hot_and_empty():
    probs = torch.eye(5)
    assert categorical(probs, torch.arange(5), torch.arange(5), 0).tolist() == [0, 1, 2, 3, 4]
    assert categorical(torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 0).numel() == 0
