"""Set-up for the tensor-parallel tests, whose engines run this process as rank 0 (the driver).

- A collective that waits for a rank that never comes fails after ``SPECDEC_TP_TIMEOUT`` seconds
  rather than gloo's default, so a hang costs minutes, not the CI run.
- The driver's watchdog ends the process (``os._exit``) when a worker dies: right for a user's
  program, but here it would take the whole pytest session with it, reporting nothing. Inside these
  tests it prints its line and stops instead; the driver's next collective then fails (gloo reports
  the closed connection at once), the test fails, and the watchdog's line is in the failure. The
  real exit is tested in a process of its own (``test_tp_failures.py``).
"""

from __future__ import annotations

import os

import pytest

import specdec.engine.workers as workers


class _WatchdogStops:
    """Stands in for ``os`` in :mod:`specdec.engine.workers`: ``_exit`` ends the watchdog's thread."""

    def __init__(self):
        self.exits: list[int] = []

    def __getattr__(self, name):
        return getattr(os, name)

    def _exit(self, code: int) -> None:
        self.exits.append(code)
        raise SystemExit(code)  # in the watchdog's thread: ends that thread only


@pytest.fixture(autouse=True)
def _tensor_parallel_guards(monkeypatch):
    monkeypatch.setenv("SPECDEC_TP_TIMEOUT", "180")  # read by every rank when it joins the group
    shim = _WatchdogStops()
    monkeypatch.setattr(workers, "os", shim)
    yield
    assert not shim.exits, "a tensor-parallel worker died during the test (its line is in the captured stderr)"
