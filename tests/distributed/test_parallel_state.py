"""``specdec.distributed.parallel_state``: the group, the collectives and their byte counts.

The collectives run in two real processes (``torch.multiprocessing.spawn``, gloo, a ``file://``
rendezvous), each checking what it received; one rank's group returns every input untouched.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.multiprocessing

from specdec.distributed import parallel_state as ps

SIZE = 2


def _collectives(rank: int, init_method: str) -> None:
    """One rank's side: every collective, with inputs that differ by rank, checked on every rank."""
    torch.set_num_threads(1)
    tp = ps.initialize(rank, SIZE, init_method, timeout_s=60)
    try:
        assert (tp.rank, tp.size, tp.is_driver) == (rank, SIZE, rank == 0)
        ps.counter.reset()

        x = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], dtype=torch.float64)
        assert ps.all_reduce(tp, x) is x and x.tolist() == [3.0, 30.0]  # in place

        part = torch.full((2, 3), float(rank), dtype=torch.float64)
        assert ps.all_gather(tp, part).tolist() == [[0.0] * 3 + [1.0] * 3] * 2  # rank order, along dim -1
        assert ps.all_gather(tp, part, dim=0).tolist() == [[0.0] * 3] * 2 + [[1.0] * 3] * 2

        with ps.phase("control"):
            message = {"events": [("add", 7)], "digest": 123}
            assert ps.broadcast_object(tp, message if rank == 0 else "ignored") == message
        assert ps.min_over_ranks(tp, [7, 3][rank]) == 3

        # Vocab-parallel logits: 7 ids padded to 8, 4 per rank; id 7 is rank 1's padding row.
        vocab, local = 7, 4
        full = torch.tensor([
            [0.0, 1.0, 9.0, 0.0, 0.0, 9.0, 0.0, 0.0],    # a tie across ranks: the lower id (2) wins
            [0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 5.0, 0.0],    # the maximum on rank 1 (id 6)
            [3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 1.0, 99.0],   # the padding row's value never wins (id 0)
            [0.0, 4.0, 0.0, 4.0, 4.0, 0.0, 0.0, 0.0],    # ties within and across ranks (id 1)
            [-5.0, -4.0, -3.0, -2.0, -1.0, -1.0, -9.0, 0.0],  # negative logits, tie across ranks (id 4)
        ], dtype=torch.float64)
        mine = full[:, rank * local:(rank + 1) * local].clone()
        assert torch.equal(ps.gather_vocab(tp, mine, vocab), full[:, :vocab])
        assert ps.argmax_vocab(tp, mine, vocab).tolist() == [2, 6, 0, 1, 4]
        assert torch.argmax(full[:, :vocab], dim=-1).tolist() == [2, 6, 0, 1, 4]  # torch's rule, one rank
        # A rank whose slice holds no id at all (3 ids over 2 ranks of 4): the other rank's id wins.
        assert ps.argmax_vocab(tp, mine, 3).tolist() == torch.argmax(full[:, :3], dim=-1).tolist()
        # Random logits with planted ties: the same ids as torch.argmax over the whole vocabulary.
        generator = torch.Generator().manual_seed(0)
        logits = torch.randn(64, 2 * 50, generator=generator, dtype=torch.float64)
        logits[::3, 70] = logits[::3, 20] = logits[::3].max(dim=-1).values + 1  # ties across ranks
        logits[1::3, 90] = logits[1::3, 99] = logits[1::3].max(dim=-1).values + 1  # ties on rank 1
        for vocab in (100, 97):
            got = ps.argmax_vocab(tp, logits[:, rank * 50:(rank + 1) * 50].clone(), vocab)
            assert got.tolist() == torch.argmax(logits[:, :vocab], dim=-1).tolist()

        # Bytes each rank sends: a ring all-reduce 2 (p - 1) / p of the tensor, an all-gather (p - 1)
        # times its part, a broadcast (the driver only) (p - 1) times the pickled object.
        want_control = len(pickle.dumps(message)) if rank == 0 else 0
        assert ps.counter.bytes.get("control", 0) == want_control
        # all_reduce 16 B; all_gather 48 B twice; gather_vocab 5 x 4 x 8 B; argmax_vocab 5 x 2 x 8 B
        # twice and 64 x 2 x 8 B twice (min_over_ranks is not counted).
        assert ps.counter.bytes["target"] == 16 + 2 * 48 + 160 + 2 * 80 + 2 * 1024
        assert ps.counter.calls["target"] == 1 + 2 + 1 + 4
    finally:
        ps.shutdown()


def test_collectives_across_two_processes(tmp_path):
    store = tmp_path / "rendezvous"
    torch.multiprocessing.spawn(_collectives, args=(f"file://{store}",), nprocs=SIZE, join=True)


def test_one_rank_returns_every_input_untouched():
    tp = ps.SINGLE
    x = torch.arange(6.0).reshape(2, 3)
    ps.counter.reset()
    assert ps.all_reduce(tp, x) is x and ps.all_gather(tp, x) is x
    assert ps.broadcast_object(tp, {"a": 1}) == {"a": 1} and ps.min_over_ranks(tp, 5) == 5
    assert ps.gather_vocab(tp, x, 3) is x
    assert ps.argmax_vocab(tp, torch.tensor([[1.0, 3.0, 3.0]]), 3).tolist() == [1]
    assert ps.counter.bytes == {} and ps.counter.calls == {}
    assert ps.initialize(0, 1, "file:///unused") is ps.SINGLE


def test_building_sets_the_group_modules_are_built_for_and_restores_it():
    assert ps.current() is ps.SINGLE
    with ps.building(1, 4) as group:
        assert ps.current() is group and (group.rank, group.size, group.group) == (1, 4, None)
        assert not group.is_driver
        with ps.replicated():
            assert ps.current() is ps.SINGLE
        assert ps.current() is group
    assert ps.current() is ps.SINGLE
    with pytest.raises(RuntimeError), ps.building(0, 2):
        raise RuntimeError("restored on the way out")
    assert ps.current() is ps.SINGLE


def test_shard_divides_or_says_what_in_one_line():
    group = ps.TensorParallelGroup(0, 4, None)
    assert group.shard(12, "heads") == 3
    with pytest.raises(ValueError) as err:
        group.shard(6, "num_attention_heads")
    assert str(err.value).splitlines() == [
        "num_attention_heads (6) is not divisible by tensor_parallel_size 4; choose a tensor_parallel_size that divides it"
    ]


def test_phases_count_apart_and_nest():
    counter = ps.CommCounter()
    counter.add(10)
    saved, ps.counter = ps.counter, counter
    try:
        with ps.phase("draft"):
            counter.add(3)
            with ps.phase("control"):
                counter.add(1)
            counter.add(2.5)
    finally:
        ps.counter = saved
    assert counter.bytes == {"target": 10, "draft": 5, "control": 1}
    assert counter.calls == {"target": 1, "draft": 2, "control": 1}
    assert counter.phase == "target"
    counter.reset()
    assert counter.bytes == {} and counter.calls == {}
