"""The tensor-parallel group this process belongs to, and the collectives the sharded layers issue.

One process per rank; each holds a slice of every sharded weight and of the KV heads. Rank 0 is the
*driver*: it receives requests and broadcasts them; every rank then runs the same engine step on the
same inputs (:mod:`specdec.distributed.step_sync`), so all ranks issue the same collectives in the
same order, every step, whether or not they have work of their own.

Models are built inside :func:`using` a group: each sharded module reads :func:`current` when it is
constructed (its shard sizes) and keeps that group for the collectives of its forwards, so engines of
different groups (a tensor-parallel one and a single-process one) live side by side in one process.
With one rank (the default) every collective returns its input untouched, so a single process runs
exactly the code it ran before tensor parallelism existed.

The collectives count the bytes each rank sends (:class:`CommCounter`), by phase, for the benchmark.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
from typing import Any, Iterator

import attrs
import torch
import torch.distributed as dist


@attrs.frozen
class TensorParallelGroup:
    """``rank`` of ``size`` ranks; ``group`` is the torch process group (None for one rank), ``idle``
    a second group over the same ranks, without a practical timeout, for the driver's step messages:
    workers wait there for as long as the driver has no requests."""

    rank: int = 0
    size: int = 1
    group: Any = None
    idle: Any = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def shard(self, total: int, what: str) -> int:
        """``total / size``; a one-line error naming ``what`` when it does not divide."""
        if total % self.size:
            raise ValueError(
                f"{what} ({total}) is not divisible by tensor_parallel_size {self.size}; "
                f"choose a tensor_parallel_size that divides it"
            )
        return total // self.size


SINGLE = TensorParallelGroup()
_current = SINGLE


def current() -> TensorParallelGroup:
    """The group modules being built now belong to (see :func:`using`; one rank by default)."""
    return _current


@contextlib.contextmanager
def using(group: TensorParallelGroup) -> Iterator[TensorParallelGroup]:
    """Build modules for ``group``: inside, :func:`current` is ``group``."""
    global _current
    saved = _current
    _current = group
    try:
        yield group
    finally:
        _current = saved


def building(rank: int, size: int):
    """Shapes of rank ``rank`` of ``size`` without a process group: the driver builds a model on the
    meta device this way to check that it shards, before starting any process."""
    return using(TensorParallelGroup(rank, size, None))


def replicated():
    """Modules built inside hold whole weights and issue no collectives (an EAGLE3 layer whole on
    every rank): the shapes of one rank, whatever the group."""
    return using(SINGLE)


# Workers wait for the driver's next step message this long (a server idle overnight is not an error);
# a driver that dies is noticed sooner, by its closed connections or the worker's parent watch.
IDLE_TIMEOUT = datetime.timedelta(days=365)


def initialize(rank: int, size: int, init_method: str, *, timeout_s: float | None = None) -> TensorParallelGroup:
    """Join the ``size``-rank group (gloo on CPUs, nccl on GPUs) as ``rank``; build inside :func:`using` it.

    A collective inside a step fails after ``timeout_s`` (default: ``SPECDEC_TP_TIMEOUT`` seconds, 600)."""
    if size == 1:
        return SINGLE
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("SPECDEC_TP_BACKEND") != "gloo" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s or float(os.environ.get("SPECDEC_TP_TIMEOUT", 600)))
    if not dist.is_initialized():
        # The world group waits as long as it takes: for a rank to join (a slow start is not an error:
        # a rank that dies is reported by the driver's watchdog, or by torchrun) and, as ``idle``, for
        # the driver's next step message.
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
    steps = dist.new_group(backend=backend, timeout=timeout)
    return TensorParallelGroup(rank, size, steps, dist.group.WORLD)


# How long a rank leaving with the others waits for them (:func:`shutdown`).
LEAVE_TIMEOUT = datetime.timedelta(seconds=30)


def shutdown(*, together: bool = False) -> None:
    """Leave this process's group, if it joined one.

    ``together``: every rank is leaving now (the driver sent its stop), so first wait for the others,
    up to :data:`LEAVE_TIMEOUT` (a rank already gone is not waited for). A rank that tore its group
    down while another still used its connections aborted when its interpreter exited ("terminate
    called without an active exception"): rank 0 under torchrun, in 3 of 10 runs of
    tests/engine/test_workers.py."""
    if not dist.is_initialized():
        return
    if together:
        try:
            dist.monitored_barrier(timeout=LEAVE_TIMEOUT)
        except RuntimeError:
            pass  # a rank that died or left: leave all the same
    dist.destroy_process_group()


# ----- byte accounting -----
@attrs.define
class CommCounter:
    """Bytes this rank sent through collectives, and how many it issued, per phase (``"target"``,
    ``"draft"``, ``"control"``...). A ring all-reduce of ``n`` bytes over ``p`` ranks sends
    ``2 (p - 1) / p * n`` per rank, an all-gather of ``n`` bytes per rank ``(p - 1) * n``."""

    bytes: dict[str, int] = attrs.field(factory=dict)
    calls: dict[str, int] = attrs.field(factory=dict)
    phase: str = "target"

    def add(self, nbytes: float) -> None:
        self.bytes[self.phase] = self.bytes.get(self.phase, 0) + int(nbytes)
        self.calls[self.phase] = self.calls.get(self.phase, 0) + 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


counter = CommCounter()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the collectives inside under ``name``."""
    saved = counter.phase
    counter.phase = name
    try:
        yield
    finally:
        counter.phase = saved


# ----- collectives -----
def all_reduce(tp: TensorParallelGroup, x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``tp`` (in place; returns it)."""
    if tp.size == 1:
        return x
    counter.add(2 * (tp.size - 1) / tp.size * x.numel() * x.element_size())
    dist.all_reduce(x, group=tp.group)
    return x


def all_gather(tp: TensorParallelGroup, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    counter.add((tp.size - 1) * x.numel() * x.element_size())
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=dim)


def broadcast_object(tp: TensorParallelGroup, obj: Any = None, *, idle: bool = False) -> Any:
    """The driver's ``obj`` on every rank (others pass anything). ``idle``: through the group without
    a timeout (the workers may wait here for a long time)."""
    if tp.size == 1:
        return obj
    if tp.is_driver:
        counter.add((tp.size - 1) * len(pickle.dumps(obj)))
    box = [obj if tp.is_driver else None]
    dist.broadcast_object_list(box, src=0, group=tp.idle if idle else tp.group)
    return box[0]


def min_over_ranks(tp: TensorParallelGroup, value: int) -> int:
    """The smallest ``value`` any rank holds (ranks agree on a size each measured for itself)."""
    if tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())


# ----- vocab-parallel logits -----
def gather_vocab(tp: TensorParallelGroup, local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's slice of the logits ``[T, V_local]`` -> the full ``[T, vocab_size]`` on every rank."""
    if tp.size == 1:
        return local_logits
    return all_gather(tp, local_logits, dim=-1)[..., :vocab_size]


def argmax_vocab(tp: TensorParallelGroup, local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The argmax over the whole vocabulary of vocab-split logits, sending two numbers per row and rank.

    Ties go to the lowest id (``torch.argmax``'s rule): ranks hold the vocabulary in order, and the
    first rank holding the maximum wins.
    """
    if tp.size == 1:
        return torch.argmax(local_logits, dim=-1)
    local_vocab = local_logits.shape[-1]
    first = tp.rank * local_vocab
    valid = max(0, min(local_vocab, vocab_size - first))  # the padding rows never win
    if valid:
        index = local_logits[..., :valid].argmax(dim=-1)
        best = local_logits.gather(-1, index.unsqueeze(-1)).squeeze(-1).double()
    else:
        index = torch.zeros(local_logits.shape[:-1], dtype=torch.long, device=local_logits.device)
        best = torch.full(local_logits.shape[:-1], float("-inf"), dtype=torch.float64, device=local_logits.device)
    pair = torch.stack([best, (index + first).double()], dim=-1)  # ids are exact in float64
    gathered = all_gather(tp, pair.unsqueeze(-2), dim=-2)  # [T, ranks, 2]
    winner = gathered[..., 0].argmax(dim=-1, keepdim=True)
    return gathered[..., 1].gather(-1, winner).squeeze(-1).long()
