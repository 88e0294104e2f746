"""``AsyncEngine``: one engine thread steps continuously while HTTP requests arrive, stream and leave.

The :class:`~specdec.engine.engine.LLMEngine` is not thread-safe, so one thread owns it. Handlers on
the event loop talk to it through a command queue (add a request, abort one) and get back, per request,
``(tag, Delta)`` items in a queue of theirs: what the request gained in a step (text safe to stream,
token ids, logprobs) and, in its last one, why it finished and its own speculation figures. Requests
of every client share the engine's steps (continuous batching).

Text, stop strings and logprobs are applied in the engine thread right after each step
(:class:`~specdec.output_processor.OutputProcessor`), so a request a stop string ends is dropped
before the next step and no step after it is counted anywhere. A step that raises fails the
requests it was running (their handlers get the error; their pages and proposer state are freed)
and the server keeps serving the rest.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Sequence

import attrs

from specdec.output_processor import OutputProcessor, RequestState
from specdec.outputs import StepOutput, TokenLogprob
from specdec.sampling.params import SamplingParams
from specdec.spec_stats import SpecStats

log = logging.getLogger("specdec.server")


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


@attrs.define
class _Submission:
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: asyncio.Queue  # receives (tag, Delta)
    tag: Any
    loop: asyncio.AbstractEventLoop
    accepted: Future  # the request id, or the ValueError that refused it

    def send(self, delta: "Delta") -> None:
        self.loop.call_soon_threadsafe(self.sink.put_nowait, (self.tag, delta))


class AsyncEngine:
    """Runs ``engine`` in a thread of its own; see the module docstring.

    ``stats`` (a :class:`~specdec.server.metrics.ServerMetrics`) is told of every step.
    """

    def __init__(self, engine, tokenizer, stats, *, max_waiting_requests: int):
        self.engine = engine
        self.stats = stats
        self.max_waiting_requests = max_waiting_requests
        self._processor = OutputProcessor(tokenizer)
        self._commands: queue.Queue = queue.Queue()
        self._live: dict[int, _Submission] = {}  # engine thread only
        self._in_flight = 0  # submitted, not yet finished (read by the event loop for the 503 limit)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._stopping = threading.Event()
        self.last_error: str | None = None

    # ----- event loop side -----
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop stepping (after the server stopped taking requests and the in-flight ones ended)."""
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout=30)

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams, sink: asyncio.Queue,
                     tag: Any = None) -> int:
        """Queue a request whose :class:`Delta` objects go to ``sink`` as ``(tag, delta)``; returns its id.

        Raises ``ValueError`` (the engine's one-line reason) for a request that can never run, and
        :class:`Overloaded` past ``max_waiting_requests``.
        """
        with self._lock:
            if self._in_flight >= self.max_waiting_requests:
                raise Overloaded(f"the server holds {self._in_flight} requests, its limit "
                                 f"(--max-waiting-requests); retry later")
            self._in_flight += 1
        loop = asyncio.get_running_loop()
        submission = _Submission(list(prompt_token_ids), params, sink, tag, loop, Future())
        self._commands.put(("add", submission))
        try:
            return await asyncio.wrap_future(submission.accepted)
        except BaseException:
            self._finished_one()
            raise

    def abort(self, request_id: int) -> None:
        """Drop a request (its client went away): pages and proposer state are freed in the engine thread."""
        self._commands.put(("abort", request_id))

    def _finished_one(self) -> None:
        with self._lock:
            self._in_flight -= 1

    # ----- engine thread -----
    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished()
            self._drain_commands(block=not busy)
            if not self.engine.has_unfinished():
                continue
            started = time.perf_counter()
            try:
                out = self.engine.step()
            except Exception as err:  # noqa: BLE001 - one failed step must not stop the server
                self._fail_running(err)
                continue
            self._deliver(out)
            self.stats.on_step(out, self.engine, time.perf_counter() - started)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            kind, value = command
            if kind == "add":
                self._add(value)
            else:
                self._abort(value, "abort")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, submission: _Submission) -> None:
        try:
            seq = self.engine.make_sequence(submission.prompt_token_ids, submission.params)
            self._processor.add(seq.seq_id, 0, submission.prompt_token_ids, submission.params)
        except ValueError as err:
            submission.accepted.set_exception(err)
            return
        self.engine.add_sequence(seq)
        self.stats.on_admitted(seq.num_prompt_tokens)
        self._live[seq.seq_id] = submission
        submission.accepted.set_result(seq.seq_id)

    def _abort(self, request_id: int, reason: str) -> None:
        if self._live.pop(request_id, None) is None:
            return
        self.engine.abort(request_id, reason)
        self._processor.requests.pop(request_id, None)
        self._finished_one()

    def _deliver(self, out: StepOutput) -> None:
        for request in self._processor.process(out):
            self.engine.abort(request, "stop")
        # One wake-up of each event loop per step, however many of its requests moved.
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for part in out.requests:
            submission = self._live.get(part.request_id)
            if submission is None:
                continue
            delta = self._delta(self._processor.requests[part.request_id])
            batches.setdefault(submission.loop, []).append((submission.sink, (submission.tag, delta)))
            if delta.finished:
                del self._live[part.request_id]
                del self._processor.requests[part.request_id]
                self._finished_one()
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    @staticmethod
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

    def _fail_running(self, err: Exception) -> None:
        message = f"the engine failed this request's step: {type(err).__name__}: {err}".splitlines()[0]
        self.last_error = message
        self.stats.step_errors.inc()
        log.error("engine step failed; failing the %d running requests: %s", len(self.engine.running_ids()),
                  message)
        for request_id in self.engine.running_ids():
            submission = self._live.get(request_id)
            self._abort(request_id, "abort")
            if submission is not None:
                submission.send(Delta("", (), error=message))


def _put_all(items) -> None:
    for sink, item in items:
        sink.put_nowait(item)


class Overloaded(RuntimeError):
    """More requests than ``--max-waiting-requests``: answered with 503."""

