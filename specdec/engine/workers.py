"""Starting, watching and stopping the ranks of a tensor-parallel engine.

``LLM(..., tensor_parallel_size=n)`` (and so every CLI command and the server) runs as rank 0, the
driver, and starts ranks 1..n-1 itself with ``torch.multiprocessing`` (spawned, on this machine);
each builds the same engine from the same :class:`~specdec.engine_args.EngineArgs` on its own shard
and follows the driver step by step (:mod:`specdec.distributed.step_sync`).

Across machines, start one process per rank with ``torchrun`` running the same script; the group
comes from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), ``LLM`` returns on
rank 0 only, and every other rank serves the driver inside ``LLM(...)`` and exits when it is done.

Failures are one line, never a hang:

- before any process starts, the driver builds the target on the meta device with rank 0's shapes,
  so a size that does not shard (heads not divisible by the rank count, ...) is an error at once;
- a worker that dies (a crash, a kill, an error only it hit) makes the driver print one line naming
  the rank and exit, since the driver may be blocked in a collective no one else will join;
- the driver stopping (``LLM.close()``, or its process exiting) stops the workers.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from specdec.distributed import parallel_state as ps
from specdec.distributed.step_sync import StopWorker
from specdec.engine_args import EngineArgs

# A worker's death is reported after this grace, so that an error every rank hits (a bad argument
# found while building) is raised by the driver itself rather than reported as the worker's.
REPORT_GRACE_SECONDS = 1.0
_TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_shards(args: EngineArgs) -> None:
    """Raise ``ValueError`` (one line) if the target does not split over ``args.tensor_parallel_size``
    ranks: it is built on the meta device with rank 0's shapes, which allocates nothing."""
    from specdec.models.loader import load_config
    from specdec.models.registry import model_class

    config = load_config(args.model)
    with ps.building(0, args.tensor_parallel_size), torch.device("meta"):
        model_class(config)(config)


def per_rank_threads(size: int) -> int:
    """Compute threads for each of ``size`` ranks sharing this machine's cores."""
    return max(1, (os.cpu_count() or 1) // size)


class WorkerGroup:
    """The driver's handle on ranks 1..n-1 (see the module docstring)."""

    def __init__(self, args: EngineArgs):
        self.size = args.tensor_parallel_size
        self._threads = torch.get_num_threads()  # the driver's, given back on close
        self._closed = threading.Event()
        self._reporting = threading.Lock()
        self._processes: dict[int, object] = {}
        self._store = None
        torchrun = torchrun_rank(self.size)
        if torchrun is None:
            self.group = self._spawn(args)
        else:
            rank, init_method = torchrun
            if rank != 0:
                run_worker(rank, self.size, init_method, args)  # serves the driver, then exits the process
            self.group = ps.initialize(0, self.size, init_method)
        torch.set_num_threads(per_rank_threads(self.size))

    def _spawn(self, args: EngineArgs) -> ps.TensorParallelGroup:
        if torch.distributed.is_initialized():
            raise ValueError(
                "this process already runs a tensor-parallel engine (one per process); close() that LLM first"
            )
        context = torch.multiprocessing.get_context("spawn")
        fd, path = tempfile.mkstemp(prefix="specdec-tp-")
        os.close(fd)
        os.unlink(path)  # the file store creates it
        self._store = Path(path)
        init_method = f"file://{path}"
        # A pipe, not a queue: a queue's lock is a semaphore that a worker ending in os._exit would leak.
        self._errors, errors_out = context.Pipe(duplex=False)
        for rank in range(1, self.size):
            process = context.Process(
                target=_spawned_worker, args=(rank, self.size, init_method, args, errors_out, os.getpid()),
                name=f"specdec-tp-{rank}", daemon=False,
            )
            process.start()
            self._processes[rank] = process
        threading.Thread(target=self._watch, name="specdec-tp-watchdog", daemon=True).start()
        return ps.initialize(0, self.size, init_method)

    def _watch(self) -> None:
        while not self._closed.wait(0.2):
            if self._dead_worker() is not None:
                if self._closed.wait(REPORT_GRACE_SECONDS):
                    return
                self._exit_reporting(self._dead_worker())

    def _dead_worker(self) -> int | None:
        return next((rank for rank, p in self._processes.items() if p.exitcode is not None), None)

    def _exit_reporting(self, rank: int) -> None:
        """One line naming the dead worker, then end the driver (it may be blocked in a collective)."""
        self._reporting.acquire()  # the watchdog and a failed step may both get here: one line only
        reason = self._reported_error() or f"exit code {self._processes[rank].exitcode}"
        print(f"specdec: tensor-parallel worker rank {rank} died ({reason}); the driver exits",
              file=sys.stderr, flush=True)
        os._exit(1)

    def _reported_error(self) -> str | None:
        try:
            return self._errors.recv() if self._errors.poll() else None
        except EOFError:  # every worker gone without a word
            return None

    def step_failed(self, error: BaseException) -> None:
        """A step raised on the driver: if a worker died (which fails the driver's collectives), report
        that in one line and exit instead of raising the collective's error."""
        deadline = time.monotonic() + REPORT_GRACE_SECONDS
        while time.monotonic() < deadline:
            rank = self._dead_worker()
            if rank is not None:
                self._exit_reporting(rank)
            time.sleep(0.05)

    def close(self, sync=None) -> None:
        """Stop the workers: tell them through ``sync`` (the engine's, once built, unless a step was
        interrupted and left them inside it) or end them."""
        if self._closed.is_set():
            return
        self._closed.set()
        if sync is not None and sync.interrupted:
            sync = None
        stopped = False
        if sync is not None:
            try:
                sync.stop()
                stopped = True
            except Exception:  # noqa: BLE001 - a worker already gone; end the rest below
                pass
        if stopped:
            ps.shutdown(together=True)  # the stopped workers leave the group with the driver, then exit
        for process in self._processes.values():
            process.join(timeout=10 if stopped else 0)
            if process.exitcode is None:
                process.kill()
                process.join(timeout=5)
        ps.shutdown()  # otherwise once they are gone
        torch.set_num_threads(self._threads)
        if self._store is not None:
            self._store.unlink(missing_ok=True)


def torchrun_rank(size: int) -> tuple[int, str] | None:
    """``(rank, "env://")`` when this process was started by torchrun for ``size`` ranks, else None."""
    if not all(key in os.environ for key in _TORCHRUN_KEYS):
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(
            f"torchrun started {world} processes but tensor_parallel_size is {size}; "
            f"run torchrun --nproc-per-node with the same number"
        )
    return int(os.environ["RANK"]), "env://"


def run_worker(rank: int, size: int, init_method: str, args: EngineArgs) -> None:
    """A worker's whole life: join the group, build the engine, follow the driver, exit."""
    from specdec.engine.build import build_engine

    torch.set_num_threads(per_rank_threads(size))
    engine = build_engine(args, ps.initialize(rank, size, init_method)).engine
    try:
        while True:
            engine.step()
    except StopWorker:
        pass
    ps.shutdown(together=True)
    sys.exit(0)


def _spawned_worker(rank: int, size: int, init_method: str, args: EngineArgs, errors, driver_pid: int) -> None:
    # The terminal's Ctrl-C reaches every process of the group; the driver decides when workers stop.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_driver, args=(driver_pid,), daemon=True).start()
    try:
        run_worker(rank, size, init_method, args)
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - reported to the driver in one line, then exit
        first = str(err).splitlines()[0] if str(err) else ""
        errors.send(f"{type(err).__name__}: {first}" if first else type(err).__name__)
        sys.exit(1)


def _exit_with_driver(driver_pid: int) -> None:
    """A worker whose driver is gone (killed without a goodbye) exits too."""
    while os.getppid() == driver_pid:
        time.sleep(0.5)
    os._exit(1)
