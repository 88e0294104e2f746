"""The server's engine loop, and the messages it exchanges with the HTTP front end.

:class:`EngineCore` owns the :class:`~specdec.engine.engine.LLMEngine` and an
:class:`~specdec.output_processor.OutputProcessor` and steps continuously: between steps it takes the
front end's commands (add a request, abort one, stop), after each step it applies text, stop strings
and logprobs (so a request a stop string ends is dropped before the next step and no step after it is
counted anywhere) and emits one :class:`Stepped` message with every request's :class:`Delta`. A step
that raises fails the requests it was running (:class:`StepFailed`; their pages and proposer state are
freed) and the loop goes on serving the rest.

The loop talks only through two callables, ``receive`` and ``emit``, and every message is a plain
picklable value, so it runs unchanged in a thread of the server's process or in a process of its own
(:mod:`specdec.server.transport`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import attrs

from specdec.output_processor import OutputProcessor, RequestState
from specdec.outputs import StepOutput, TokenLogprob
from specdec.spec_stats import SpecStats

NOTHING = object()  # what ``receive`` returns when no command is waiting


@attrs.frozen
class Delta:
    """What one request gained in a step; ``finish_reason`` and ``spec`` are set in its last one, and
    ``error`` when the engine failed it."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    spec: SpecStats | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@attrs.frozen
class EngineSnapshot:
    """The engine's gauges and running totals after a change: what ``/metrics`` shows. The totals
    (preemptions, prefix-cache queries and hits, in tokens, warnings about speculation: a draft that
    does not fit its target, collapsed acceptance) count since the engine was built."""

    running: int
    waiting: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decode_warnings: int = 0

    @classmethod
    def of(cls, engine) -> "EngineSnapshot":
        prefix = engine.prefix_cache_stats()
        spec = engine.spec_stats
        return cls(len(engine.running_ids()), engine.num_waiting(), engine.cache.usage(),
                   engine.stats.num_preemptions, prefix.queries, prefix.hits, len(spec.warnings) if spec else 0)


# ----- commands, front end -> core -----
@attrs.frozen
class Add:
    ticket: int
    prompt_token_ids: tuple[int, ...]
    params: Any  # SamplingParams


@attrs.frozen
class Abort:
    request_id: int


STOP = None


# ----- messages, core -> front end -----
@attrs.frozen
class Ready:
    """Sent once by an engine process when its model is loaded."""

    max_model_len: int
    num_speculative_tokens: int


@attrs.frozen
class StartFailed:
    message: str


@attrs.frozen
class Accepted:
    ticket: int
    request_id: int
    num_prompt_tokens: int
    snapshot: EngineSnapshot


@attrs.frozen
class Refused:
    ticket: int
    message: str  # the engine's one-line reason (answered with 400)


@attrs.frozen
class Stepped:
    out: StepOutput
    deltas: tuple[tuple[int, Delta], ...]
    seconds: float
    snapshot: EngineSnapshot


@attrs.frozen
class StepFailed:
    message: str
    deltas: tuple[tuple[int, Delta], ...]  # an error Delta for every request the step was running
    snapshot: EngineSnapshot


@attrs.frozen
class Dropped:
    """Requests the front end aborted (their clients went away), now freed."""

    request_ids: tuple[int, ...]
    snapshot: EngineSnapshot


class EngineCore:
    """Steps ``engine`` for as long as ``receive`` gives no :data:`STOP`; see the module docstring."""

    def __init__(self, engine, tokenizer):
        self.engine = engine
        self._processor = OutputProcessor(tokenizer)

    def run(self, receive: Callable[[float | None], Any], emit: Callable[[Any], None]) -> None:
        """``receive(timeout)`` returns the next command, or :data:`NOTHING` after ``timeout`` seconds
        (``0``: do not wait); ``emit(message)`` sends one message to the front end."""
        while True:
            busy = self.engine.has_unfinished()
            if not self._take_commands(receive, emit, wait=0.0 if busy else 0.5):
                return
            if not self.engine.has_unfinished():
                continue
            started = time.perf_counter()
            try:
                out = self.engine.step()
            except Exception as err:  # noqa: BLE001 - one failed step must not stop the server
                emit(self._fail_running(err))
                continue
            emit(self._deliver(out, time.perf_counter() - started))

    def _take_commands(self, receive, emit, wait: float) -> bool:
        """Apply every waiting command (waiting up to ``wait`` s for the first); False on STOP."""
        dropped: list[int] = []
        command = receive(wait)
        while command is not NOTHING:
            if command is STOP:
                return False
            if isinstance(command, Add):
                emit(self._add(command))
            elif self._abort(command.request_id, "abort"):
                dropped.append(command.request_id)
            command = receive(0.0)
        if dropped:
            emit(Dropped(tuple(dropped), EngineSnapshot.of(self.engine)))
        return True

    def _add(self, command: Add) -> Accepted | Refused:
        try:
            seq = self.engine.make_sequence(list(command.prompt_token_ids), command.params)
        except ValueError as err:
            return Refused(command.ticket, str(err).splitlines()[0])
        self._processor.add(seq.seq_id, 0, command.prompt_token_ids, command.params)
        self.engine.add_sequence(seq)
        return Accepted(command.ticket, seq.seq_id, seq.num_prompt_tokens, EngineSnapshot.of(self.engine))

    def _abort(self, request_id: int, reason: str) -> bool:
        if self._processor.requests.pop(request_id, None) is None:
            return False  # finished already: its last Delta is on its way
        self.engine.abort(request_id, reason)
        return True

    def _deliver(self, out: StepOutput, seconds: float) -> Stepped:
        for request in self._processor.process(out):
            self.engine.abort(request, "stop")
        deltas = []
        for part in out.requests:
            state = self._processor.requests.get(part.request_id)
            if state is None:
                continue
            delta = _delta(state)
            deltas.append((part.request_id, delta))
            if delta.finished:
                del self._processor.requests[part.request_id]
        return Stepped(out, tuple(deltas), seconds, EngineSnapshot.of(self.engine))

    def _fail_running(self, err: Exception) -> StepFailed:
        message = f"the engine failed this request's step: {type(err).__name__}: {err}".splitlines()[0]
        failed = [rid for rid in self.engine.running_ids() if self._abort(rid, "abort")]
        return StepFailed(message, tuple((rid, Delta("", (), error=message)) for rid in failed),
                          EngineSnapshot.of(self.engine))


def _delta(state: RequestState) -> Delta:
    tokens, logprobs = state.new_tokens()
    finished = state.finished
    text = state.stream.unsent(finished) if state.stream is not None else ""
    return Delta(
        text=text,
        token_ids=tuple(tokens),
        logprobs=tuple(logprobs) if logprobs is not None else None,
        prompt_logprobs=state.take_prompt_logprobs(),
        finish_reason=state.finish_reason,
        num_prompt_tokens=len(state.prompt_token_ids),
        spec=state.spec if finished else None,
    )
