"""Where the server's :class:`~specdec.server.engine_core.EngineCore` runs: a process of its own
(the default) or a thread of the server's process.

The engine is bound by the interpreter lock: a small model's step is thousands of short torch calls,
each taking the lock back from whoever holds it. In one process the HTTP side's work (parsing
requests, formatting stream chunks) competes for that lock, and measured on the zoo MiniMax-M3 pair a
Python thread busy 10% of the time slows a step by about 20%. So ``specdec serve`` runs the engine in
a process of its own (as vLLM's engine core does) and exchanges picklable commands and messages with it
over two pipes; a reader thread in the server hands each message to the front end.

In a thread (``--no-engine-process``) the core shares the server's process: tests use it to look
inside the engine, and a proposer registered in code (not by entry point) is only known there, since
an engine process is spawned afresh and sees what the package and its entry points register.

With ``--tensor-parallel-size`` above 1 the engine (in its process or in the server's) is rank 0 and
starts the other ranks' worker processes itself. A daemonic process may not start processes, so the
engine process is then an ordinary child; either way it ends with the server: :meth:`EngineProcess.stop`
(the server's shutdown, or the server's interpreter exiting without one), or the command pipe closing
when the server dies outright. Whichever way the engine's loop ends, ``LLM.close()`` stops the workers,
and workers whose driver is gone exit too.
"""

from __future__ import annotations

import atexit
import multiprocessing
import queue
import signal
import threading
import weakref
from typing import Any, Callable

from specdec.server.engine_core import NOTHING, STOP, EngineCore, Ready, StartFailed

START_TIMEOUT_SECONDS = 600.0  # loading the model; a start that takes longer is reported as failed


class EngineDied(RuntimeError):
    """The engine process ended while the server was running."""


class EngineThread:
    """The core in a thread of this process, over the already built ``llm``."""

    def __init__(self, llm):
        self.llm = llm
        self.max_model_len = llm.max_model_len
        self.num_speculative_tokens = llm.engine.num_speculative_tokens
        self._commands: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self, dispatch: Callable[[Any], None]) -> None:
        core = EngineCore(self.llm.engine, self.llm.tokenizer)
        self._thread = threading.Thread(target=core.run, args=(self._receive, dispatch),
                                        name="specdec-engine", daemon=True)
        self._thread.start()

    def _receive(self, timeout: float) -> Any:
        try:
            return self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
        except queue.Empty:
            return NOTHING

    def send(self, command: Any) -> None:
        self._commands.put(command)

    def stop(self) -> None:
        self._commands.put(STOP)
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                return  # still inside a step: closing now would race it; the process exit ends the workers
        self.llm.close()  # the tensor-parallel workers (nothing with one rank)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class EngineProcess:
    """The core in a spawned process that builds the engine from ``args`` (a ``ServerArgs``).

    Construction waits until the model is loaded; a start that fails raises ``ValueError`` with the
    engine's one-line reason (a bad checkpoint or config reads as it would in one process).
    """

    def __init__(self, args):
        context = multiprocessing.get_context("spawn")  # fork would copy the server's threads and locks
        commands_in, self._commands_out = context.Pipe(duplex=False)  # (reading end, writing end)
        self._events_in, events_out = context.Pipe(duplex=False)
        import torch

        # The engine computes with this process's thread count, as it would in a thread of it. A daemonic
        # process cannot start the workers of tensor_parallel_size > 1 (see the module docstring).
        self._process = context.Process(target=_engine_main,
                                        args=(args, torch.get_num_threads(), commands_in, events_out),
                                        name="specdec-engine", daemon=args.tensor_parallel_size == 1)
        self._process.start()
        commands_in.close()
        events_out.close()
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        # Before multiprocessing's own exit handler (atexit runs last-registered first), which would
        # wait for an ordinary child forever and terminate a daemonic one that ignores SIGTERM.
        atexit.register(_stop_at_exit, weakref.ref(self))
        ready = self._first_message()
        if isinstance(ready, StartFailed):
            self._process.join(timeout=30)
            raise ValueError(ready.message)
        self.max_model_len = ready.max_model_len
        self.num_speculative_tokens = ready.num_speculative_tokens

    def _first_message(self) -> Ready | StartFailed:
        try:
            if self._events_in.poll(START_TIMEOUT_SECONDS):
                return self._events_in.recv()
        except (EOFError, OSError):
            pass
        self._process.kill()
        return StartFailed(f"the engine process did not start (exit code {self._process.exitcode}); "
                           f"run with --no-engine-process to see its error in this process")

    def start(self, dispatch: Callable[[Any], None]) -> None:
        def read() -> None:
            while True:
                try:
                    message = self._events_in.recv()
                except (EOFError, OSError):
                    break
                dispatch(message)
            if self._process.is_alive():
                self._process.join(timeout=5)
            if self._process.exitcode not in (0, None):
                dispatch(EngineDied(f"the engine process exited with code {self._process.exitcode}"))

        self._reader = threading.Thread(target=read, name="specdec-engine-reader", daemon=True)
        self._reader.start()

    def send(self, command: Any) -> None:
        with self._send_lock:
            try:
                self._commands_out.send(command)
            except (BrokenPipeError, OSError):
                pass  # the process is gone; the reader reports it

    def stop(self) -> None:
        """Stop the engine process (it closes its LLM, and so its tensor-parallel workers, on the way out)."""
        self.send(STOP)
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)
        if self._reader is not None:
            self._reader.join(timeout=5)

    def alive(self) -> bool:
        return self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid


def _stop_at_exit(ref: "weakref.ref[EngineProcess]") -> None:
    transport = ref()
    if transport is not None and transport.alive():
        transport.stop()


def _engine_main(args, num_threads: int, commands, events) -> None:
    """The engine process: build the engine, say Ready (or why not), then run the core."""
    # Ctrl-C reaches every process of the terminal's group; the server shuts down gracefully and
    # then stops this process with a STOP command.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    from specdec.llm import LLM

    torch.set_num_threads(num_threads)
    try:
        llm = LLM.from_engine_args(args)
    except Exception as err:  # noqa: BLE001 - reported to the server as its one-line start error
        events.send(StartFailed(str(err).splitlines()[0] if str(err) else type(err).__name__))
        return

    def receive(timeout: float) -> Any:
        if not commands.poll(timeout):
            return NOTHING
        return commands.recv()

    try:
        events.send(Ready(llm.max_model_len, llm.engine.num_speculative_tokens))
        EngineCore(llm.engine, llm.tokenizer).run(receive, events.send)
    except (EOFError, BrokenPipeError, OSError):
        pass  # the server is gone
    finally:
        llm.close()  # stops the tensor-parallel workers (nothing with one rank)
