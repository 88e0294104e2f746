"""``AsyncEngine``: the event loop's side of the engine. Handlers submit requests and abort them; each
request's :class:`~specdec.server.engine_core.Delta` objects come back in a queue of its handler's.

The engine itself runs in an :class:`~specdec.server.engine_core.EngineCore` that steps continuously,
in a process of its own or a thread (:mod:`specdec.server.transport`); requests of every client share
its steps (continuous batching). Messages from the core arrive in one thread (the engine thread, or the
reader of the engine process's pipe), which alone touches the table of live requests, counts them into
the metrics and wakes each event loop once per step, however many of its requests moved.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from concurrent.futures import Future
from typing import Any, Sequence

import attrs

from specdec.sampling.params import SamplingParams
from specdec.server.engine_core import (
    Abort,
    Accepted,
    Add,
    Delta,
    Dropped,
    Refused,
    StepFailed,
    Stepped,
)
from specdec.server.transport import EngineDied

log = logging.getLogger("specdec.server")


class Unavailable(RuntimeError):
    """The server cannot take a request now: answered with 503."""


class Overloaded(Unavailable):
    """More requests than ``--max-waiting-requests``."""


@attrs.define
class _Submission:
    sink: asyncio.Queue  # receives (tag, Delta)
    tag: Any
    loop: asyncio.AbstractEventLoop
    accepted: Future  # the request id, or the ValueError that refused it


class AsyncEngine:
    """The front end of ``transport`` (an ``EngineThread`` or ``EngineProcess``); see the module docstring.

    ``stats`` (a :class:`~specdec.server.metrics.ServerMetrics`) is told of every step.
    """

    def __init__(self, transport, stats, *, max_waiting_requests: int):
        self.transport = transport
        self.stats = stats
        self.max_waiting_requests = max_waiting_requests
        self._tickets = itertools.count()
        self._pending: dict[int, _Submission] = {}  # sent, not yet accepted or refused
        self._live: dict[int, _Submission] = {}  # dispatch thread only
        self._in_flight = 0  # submitted, not yet finished (read by the event loop for the 503 limit)
        self._lock = threading.Lock()
        self._dead: str | None = None  # why the engine process ended, once it has

    # ----- event loop side -----
    def start(self) -> None:
        self.transport.start(self._dispatch)

    def stop(self) -> None:
        """Stop stepping (after the server stopped taking requests and the in-flight ones ended)."""
        self.transport.stop()

    def alive(self) -> bool:
        return self._dead is None and self.transport.alive()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams, sink: asyncio.Queue,
                     tag: Any = None) -> int:
        """Queue a request whose :class:`Delta` objects go to ``sink`` as ``(tag, delta)``; returns its id.

        Raises ``ValueError`` (the engine's one-line reason) for a request that can never run,
        :class:`Overloaded` past ``max_waiting_requests`` and :class:`Unavailable` once the engine died.
        """
        with self._lock:
            if self._in_flight >= self.max_waiting_requests:
                raise Overloaded(f"the server holds {self._in_flight} requests, its limit "
                                 f"(--max-waiting-requests); retry later")
            self._in_flight += 1
        submission = _Submission(sink, tag, asyncio.get_running_loop(), Future())
        ticket = next(self._tickets)
        self._pending[ticket] = submission
        if self._dead is not None:  # checked after the insertion, so _engine_died cannot miss it
            _refuse(submission.accepted, self._dead)
        else:
            self.transport.send(Add(ticket, tuple(prompt_token_ids), params))
        try:
            return await asyncio.wrap_future(submission.accepted)
        except BaseException:
            self._pending.pop(ticket, None)
            self._finished_one()
            raise

    def abort(self, request_id: int) -> None:
        """Drop a request (its client went away): pages and proposer state are freed by the engine."""
        self.transport.send(Abort(request_id))

    def _finished_one(self) -> None:
        with self._lock:
            self._in_flight -= 1

    # ----- dispatch thread -----
    def _dispatch(self, message: Any) -> None:
        if isinstance(message, Stepped):
            self._send(message.deltas)
            self.stats.on_step(message.out, message.snapshot, message.seconds)
        elif isinstance(message, Accepted):
            submission = self._pending.pop(message.ticket)
            self._live[message.request_id] = submission
            self.stats.on_admitted(message.num_prompt_tokens, message.snapshot)
            submission.accepted.set_result(message.request_id)
        elif isinstance(message, Refused):
            self._pending.pop(message.ticket).accepted.set_exception(ValueError(message.message))
        elif isinstance(message, Dropped):
            for request_id in message.request_ids:
                if self._live.pop(request_id, None) is not None:
                    self._finished_one()
            self.stats.observe(message.snapshot)
        elif isinstance(message, StepFailed):
            self.stats.step_errors.inc()
            log.error("engine step failed; failing the %d running requests: %s", len(message.deltas),
                      message.message)
            self._send(message.deltas)
            self.stats.observe(message.snapshot)
        elif isinstance(message, EngineDied):
            self._engine_died(str(message))

    def _send(self, deltas: Sequence[tuple[int, Delta]]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, delta in deltas:
            submission = self._live.get(request_id)
            if submission is None:
                continue
            batches.setdefault(submission.loop, []).append((submission.sink, (submission.tag, delta)))
            if delta.finished:
                del self._live[request_id]
                self._finished_one()
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _engine_died(self, message: str) -> None:
        """Fail everything in flight: nothing accepted is left without an answer."""
        self._dead = message
        log.error("%s; failing %d requests", message, len(self._live) + len(self._pending))
        for ticket in list(self._pending):
            submission = self._pending.pop(ticket, None)
            if submission is not None:
                submission.loop.call_soon_threadsafe(_refuse, submission.accepted, message)
        self._send([(request_id, Delta("", (), error=message)) for request_id in list(self._live)])


def _put_all(items) -> None:
    for sink, item in items:
        sink.put_nowait(item)


def _refuse(accepted: Future, message: str) -> None:
    if not accepted.done():
        accepted.set_exception(Unavailable(message))
