"""A tensor-parallel ``LLM`` over its life: idle for longer than a step may take, interrupted in the
middle of a step (Ctrl-C), closed, and collected.

- Workers wait for the driver's next step in a group without a timeout, so a server idle for longer
  than ``SPECDEC_TP_TIMEOUT`` (the limit on one collective inside a step) still serves.
- A step interrupted on the driver leaves the workers inside it, waiting in a collective where no
  stop message reaches them: ``close()`` ends them at once rather than after the timeout.
- ``close()`` lets go of the ``LLM`` (its exit hook no longer holds it).
"""

from __future__ import annotations

import gc
import multiprocessing
import time
import weakref

import pytest

from specdec import LLM, SamplingParams
from specdec.zoo import zoo_path

STEP_TIMEOUT_S = 4


def test_idle_past_the_step_timeout_then_an_interrupted_step_then_close(monkeypatch):
    monkeypatch.setenv("SPECDEC_TP_TIMEOUT", str(STEP_TIMEOUT_S))  # the workers inherit it when spawned
    llm = LLM(str(zoo_path("llama-tiny")), dtype="float64", kv_cache_memory=1 << 22, tensor_parallel_size=2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids

    time.sleep(STEP_TIMEOUT_S + 2)  # idle: the workers wait in the group without a timeout
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids == first

    def interrupted():
        raise KeyboardInterrupt  # on the driver only: the workers are already inside the step

    monkeypatch.setattr(llm.engine, "_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[8, 9]], params, use_tqdm=False)
    started = time.monotonic()
    llm.close()
    assert time.monotonic() - started < STEP_TIMEOUT_S / 2, "close() waited for the workers' collective to time out"
    assert multiprocessing.active_children() == []

    collected = weakref.ref(llm)
    del llm
    gc.collect()
    assert collected() is None, "something (an exit hook) still holds the closed LLM"
