import pytest
import torch

from specdec.verifiers import GreedyVerifier, available_verifiers, get_verifier


def reference_greedy(target_logits, drafts, num_drafts):
    """Per-request Python loop, the textbook definition."""
    out, row = [], 0
    for b in range(len(num_drafts)):
        n = num_drafts[b]
        best = [int(target_logits[row + j].argmax()) for j in range(n + 1)]
        emitted = []
        for j in range(n):
            if drafts[b][j] != best[j]:
                break
            emitted.append(drafts[b][j])
        emitted.append(best[len(emitted)])
        out.append(emitted)
        row += n + 1
    return out


def test_hand_computed_case():
    v = 5
    def one_hot_logits(ids):
        return torch.nn.functional.one_hot(torch.tensor(ids), v).to(torch.float64)
    # request 0: argmax 1,2,3,4 with drafts 1,2,0 -> accept 2, emit 1,2,3
    # request 1: no drafts, argmax 4 -> emit 4
    # request 2: argmax 0,0 with drafts 0 -> accept all, bonus 0
    logits = one_hot_logits([1, 2, 3, 4, 4, 0, 0])
    drafts = torch.tensor([[1, 2, 0], [-1, -1, -1], [0, -1, -1]])
    res = GreedyVerifier().verify(logits, drafts, torch.tensor([3, 0, 1]))
    assert res.num_accepted.tolist() == [2, 0, 1]
    assert res.num_emitted.tolist() == [3, 1, 2]
    assert res.output_token_ids.tolist() == [[1, 2, 3, -1], [4, -1, -1, -1], [0, 0, -1, -1]]
    assert res.emitted() == [[1, 2, 3], [4], [0, 0]]


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_matches_reference_on_random_batches(k):
    gen = torch.Generator().manual_seed(k)
    vocab, num_req = 4, 40  # a tiny vocabulary makes long accepted prefixes common
    for _ in range(5):
        num_drafts = torch.randint(0, k + 1, (num_req,), generator=gen)
        logits = torch.randn(int(num_drafts.sum()) + num_req, vocab, generator=gen, dtype=torch.float64)
        drafts = torch.randint(0, vocab, (num_req, k), generator=gen)
        drafts[torch.arange(k).unsqueeze(0) >= num_drafts.unsqueeze(1)] = -1
        res = GreedyVerifier().verify(logits, drafts, num_drafts)
        expected = reference_greedy(logits, drafts.tolist(), num_drafts.tolist())
        assert res.emitted() == expected
        assert torch.equal(res.num_emitted, res.num_accepted + 1)
        # The engine's form, drafts as lists: the same verdict.
        listed = [row[:n] for row, n in zip(drafts.tolist(), num_drafts.tolist())]
        num_accepted, emitted = GreedyVerifier().verify_lists(logits, listed)
        assert emitted == expected
        assert num_accepted == res.num_accepted.tolist()


def test_input_errors_name_the_problem():
    v = GreedyVerifier()
    logits = torch.zeros(4, 6)
    drafts = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_logits"):
        v.verify(torch.zeros(3, 6), drafts, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="num_drafts must lie"):
        v.verify(torch.zeros(5, 6), drafts, torch.tensor([3, 0]))
    with pytest.raises(ValueError, match=r"num_drafts must be \[2\]"):
        v.verify(logits, drafts, torch.tensor([1, 1, 0]))
    with pytest.raises(ValueError, match="vocabulary"):
        v.verify(logits, torch.tensor([[6, 0], [0, 0]]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="draft_probs"):
        v.verify(logits, drafts, torch.tensor([1, 1]), torch.zeros(2, 2, 5))
    with pytest.raises(ValueError, match=r"draft_token_ids must be \[B, k\]"):
        v.verify(logits, torch.zeros(2, dtype=torch.int64), torch.tensor([1, 1]))
    # Padding outside num_drafts is never read, whatever it holds.
    assert v.verify(logits, torch.tensor([[0, 99], [0, -7]]), torch.tensor([1, 1])).num_emitted.tolist() == [2, 2]


def test_listed_drafts_must_match_the_logits_rows():
    with pytest.raises(ValueError, match="target_logits has 4 rows for drafts needing 3"):
        GreedyVerifier().verify_lists(torch.zeros(4, 6), [[1], []])
    with pytest.raises(ValueError, match="target_logits has 2 rows for drafts needing 3"):
        GreedyVerifier().verify_lists(torch.zeros(2, 6), [[1], []])


def test_registry():
    assert available_verifiers() == ["coupled", "greedy", "rejection"]
    assert get_verifier("greedy").name == "greedy"
    with pytest.raises(ValueError, match="greedy"):
        get_verifier("typical")
