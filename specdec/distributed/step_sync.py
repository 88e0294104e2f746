"""Lockstep of the ranks' engines: the driver broadcasts what changed, then every rank steps.

Every rank runs the same :class:`~specdec.engine.engine.LLMEngine` (scheduler, cache bookkeeping,
proposer, sampler) over its own shard of the weights and KV heads; only the driver (rank 0) hears
from users. At the start of each step the driver broadcasts a :class:`StepMessage`: the requests
added and aborted since the last step, in order, and a digest of every token emitted so far. The
workers apply the same changes and take the same step, so all ranks schedule the same batch, issue
the same collectives in the same order (a rank with nothing of its own to compute still joins them:
a missing collective would hang the group) and emit the same tokens; a worker whose digest differs
from the driver's stops with an error rather than drift silently. This is the arrangement SGLang
uses for its tensor-parallel schedulers; the per-step message costs one small broadcast.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from specdec.distributed import parallel_state as ps


class StopWorker(Exception):
    """The driver ended the run: a worker's loop returns."""


@attrs.frozen
class StepMessage:
    """What the driver's engine did between two steps, for the workers to do too.

    ``events`` are ``("add", sequence)`` and ``("abort", request_id, reason)`` in the order they
    happened; ``digest`` is the driver's :attr:`StepSync.digest` before this step; ``state`` what the
    driver's engine decides from that is its own (``LLMEngine.lockstep_state``: its timings)."""

    events: tuple[tuple[Any, ...], ...] = ()
    digest: int = 0
    stop: bool = False
    state: Any = None


class StepSync:
    """One rank's side of the lockstep (see the module docstring); the engine calls it."""

    def __init__(self, group: ps.TensorParallelGroup, on_failure: Callable[[BaseException], None] | None = None):
        """``on_failure``: called on the driver with an error a step raised (a collective failing
        because a worker died...), before it propagates."""
        self.group = group
        self.on_failure = on_failure
        self._events: list[tuple[Any, ...]] = []
        self.digest = 0  # a hash of every (request, tokens) the engine emitted, step by step
        self.steps = 0
        # True from a step's start until it completes: a step that raised leaves the workers inside it
        # (waiting in a collective), where no stop message can reach them.
        self.interrupted = False

    @property
    def is_driver(self) -> bool:
        return self.group.is_driver

    def added(self, seq) -> None:
        """The driver queued ``seq``."""
        if self.is_driver:
            self._events.append(("add", seq))

    def aborted(self, request_id: int, reason: str) -> None:
        """The driver aborted ``request_id``."""
        if self.is_driver:
            self._events.append(("abort", request_id, reason))

    def step(self, engine, take_step: Callable[[], Any]) -> Any:
        """One lockstep step of ``engine``: exchange the changes, ``take_step()``, fold its output in."""
        self.interrupted = True
        try:
            self._exchange(engine)
            out = take_step()
        except BaseException as err:
            if self.on_failure is not None and self.is_driver and not isinstance(err, KeyboardInterrupt):
                self.on_failure(err)
            raise
        self.interrupted = False
        self.steps += 1
        self.digest = hash((self.digest, tuple((r.request_id, r.new_token_ids) for r in out.requests)))
        return out

    def _exchange(self, engine) -> None:
        """Before a step: the driver sends its changes; a worker receives them and applies them to ``engine``."""
        with ps.phase("control"):
            if self.is_driver:
                message = StepMessage(tuple(self._events), self.digest, state=engine.lockstep_state())
                self._events.clear()
                ps.broadcast_object(self.group, message, idle=True)
                return
            message = ps.broadcast_object(self.group, idle=True)
        if message.stop:
            raise StopWorker
        if message.digest != self.digest:
            raise RuntimeError(
                f"tensor-parallel rank {self.group.rank} diverged from the driver before step {self.steps}: "
                "its emitted tokens differ (a rank-dependent computation in the engine)"
            )
        for event in message.events:
            if event[0] == "add":
                engine.add_sequence(event[1])
            else:
                engine.abort(event[1], event[2])
        engine.load_lockstep_state(message.state)

    def stop(self) -> None:
        """The driver ends the run: every worker's next exchange raises :class:`StopWorker`."""
        if self.is_driver:
            with ps.phase("control"):
                ps.broadcast_object(self.group, StepMessage(stop=True), idle=True)
