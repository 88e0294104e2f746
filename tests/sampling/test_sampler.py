import pytest
import torch
from scipy import stats

from specdec.sampling import Sampler, SamplingBatch, SamplingParams, target_probs


def test_greedy_rows_are_argmax():
    logits = torch.randn(9, 31, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    batch = SamplingBatch.from_params([SamplingParams()] * 9, list(range(9)))
    assert torch.equal(Sampler().sample(logits, batch), logits.argmax(-1))
    assert torch.equal(Sampler().sample(logits, None), logits.argmax(-1))  # no batch: every row greedy
    with pytest.raises(ValueError, match="must be \\[N, V\\]"):
        Sampler().sample(logits[0], None)


def test_seeded_rows_do_not_depend_on_batch_composition_or_order():
    gen = torch.Generator().manual_seed(2)
    vocab = 50
    mine = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=s)
            for t, p, k, s in [(1.0, 1.0, 0, 7), (0.7, 0.9, 0, 8), (1.3, 1.0, 10, 9), (0.0, 1.0, 0, None)]]
    my_logits = torch.randn(4, vocab, generator=gen)
    my_pos = [3, 10, 10, 4]
    sampler = Sampler()

    def run(n_others, order, other_seed):
        others = [SamplingParams(temperature=1.0, seed=other_seed + i) for i in range(n_others)]
        params = mine + others
        logits = torch.cat([my_logits, torch.randn(n_others, vocab, generator=gen)])
        pos = my_pos + list(range(n_others))
        perm = torch.tensor(order(len(params)))
        batch = SamplingBatch.from_params([params[i] for i in perm], [pos[i] for i in perm])
        out = sampler.sample(logits[perm], batch)
        back = torch.empty_like(out)
        back[perm] = out
        return back[:4]

    alone = run(0, lambda n: list(range(n)), 0)
    crowded = run(13, lambda n: list(reversed(range(n))), 100)
    shuffled = run(5, lambda n: torch.randperm(n, generator=gen).tolist(), 50)
    assert torch.equal(alone, crowded) and torch.equal(alone, shuffled)


def test_position_and_seed_change_the_draw():
    logits = torch.zeros(400, 1000)
    same_seed = SamplingBatch.from_params([SamplingParams(temperature=1.0, seed=5)] * 400, list(range(400)))
    assert len(set(Sampler().sample(logits, same_seed).tolist())) > 300


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 4, 1.0), (1.2, 0, 0.7)])
def test_empirical_law_matches_target_probs(temperature, top_k, top_p):
    n, vocab = 20000, 7
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, 0.9, -1.5], dtype=torch.float64)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n
    batch = SamplingBatch.from_params(params, [0] * n, default_seeds=range(n))
    counts = torch.bincount(Sampler().sample(logits.expand(n, -1), batch), minlength=vocab)
    p = target_probs(logits[None], batch.temperature[:1], batch.top_k[:1], batch.top_p[:1])[0]
    assert bool((counts[p == 0] == 0).all())
    live = p > 0
    assert stats.chisquare(counts[live].numpy(), (p[live] * n).numpy()).pvalue > 0.001


def test_from_params_errors():
    with pytest.raises(ValueError, match="default_seeds"):
        SamplingBatch.from_params([SamplingParams(temperature=1.0)], [0])
    with pytest.raises(ValueError, match="positions"):
        SamplingBatch.from_params([SamplingParams()], [0, 1])
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingBatch.from_params([{"temperature": 1.0}], [0])
    with pytest.raises(ValueError, match="rows"):
        Sampler().sample(torch.zeros(3, 4), SamplingBatch.from_params([SamplingParams()], [0]))


def test_expand_gives_per_token_rows():
    batch = SamplingBatch.from_params(
        [SamplingParams(temperature=1.0, seed=1), SamplingParams(), SamplingParams(top_k=3, seed=4)], [5, 0, 9])
    per_token = batch.expand(torch.tensor([2, 0, 3]))
    assert per_token.counters.tolist() == [5, 6, 9, 10, 11]
    assert per_token.seeds.tolist() == [1, 1, 4, 4, 4]
    assert per_token.top_k.tolist() == [0, 0, 3, 3, 3]
