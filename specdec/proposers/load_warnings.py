"""Warnings found while loading a draft: logged at once, and collected for what the engine reports.

A check that finds something suspicious but not certain (a draft trained for another target, a
config flag its trainer ignored) calls :func:`warn`. The line goes to the ``specdec`` logger, once
per process under tensor parallelism (rank 0), and to the list of the innermost :func:`collecting`
block, which is how :func:`~specdec.engine.build.build_engine` hands them to the engine's
``spec_stats().warnings``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Iterator

from specdec.distributed import parallel_state as ps

log = logging.getLogger("specdec")

_collected: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("specdec_load_warnings", default=None)


def warn(message: str) -> None:
    """Log ``message`` as a warning and add it to the warnings being collected, if any."""
    if ps.current().rank == 0:  # every rank loads the draft; one line is enough
        log.warning(message)
    found = _collected.get()
    if found is not None and message not in found:
        found.append(message)


@contextlib.contextmanager
def collecting() -> Iterator[list[str]]:
    """Collect the messages :func:`warn` is given inside the block into the list it yields."""
    found: list[str] = []
    token = _collected.set(found)
    try:
        yield found
    finally:
        _collected.reset(token)
