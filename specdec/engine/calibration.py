"""The adaptive controller's starting target curve: forwards of growing size timed when the engine
starts (:func:`calibrate`), on throwaway requests, before any step has measured them."""

from __future__ import annotations

import itertools
from typing import Callable, Hashable

from specdec.cache.paged_cache import KVCacheError
from specdec.engine.goodput import GoodputController, clock
from specdec.runtime.layout import StepLayout

CALIBRATION_MAX_ROWS = 256  # larger forwards are extrapolated until a step measures them
_CALIBRATION_REQUEST = "goodput-calibration"
_SPREAD = 7919  # a prime: successive rows' token ids land far apart in the vocabulary


def calibrate(
    controller: GoodputController,
    forward: Callable[[StepLayout, list[list[int]]], object],
    free: Callable[[Hashable], None],
    *,
    max_rows: int,
    max_requests: int,
    vocab_size: int,
) -> None:
    """Time target forwards of :func:`calibration_sizes` rows laid out like decode steps (requests of
    1 + k rows, at most ``max_requests`` of them), on throwaway requests freed after: the target
    curve's first points. Stops early when the KV cache cannot hold a size (the curve extrapolates
    from there).

    The rows carry distinct token ids spread over the vocabulary: a mixture of experts routes equal
    tokens to the same few experts, and a forward of one token repeated would price its rows like a
    small dense model's (on the zoo MiniMax-M3, 128 rows cost 2x one row with one token repeated,
    2.5-3x with distinct ones)."""
    device, measured = controller.device, 0
    for rows in calibration_sizes(controller.k, max_rows):
        requests = min(rows, max_requests)
        # The rows spread evenly over the requests, each at most 1 + k of them.
        even, more = divmod(min(rows, requests * (controller.k + 1)), requests)
        lengths = [even + 1] * more + [even] * (requests - more)
        ids = [(_CALIBRATION_REQUEST, i) for i in range(requests)]
        layout = StepLayout.build(ids, [0] * requests, lengths, [n - 1 for n in lengths], device)
        if layout.num_rows <= measured:
            break  # as many requests as may run, each with all its drafts: the largest decode step
        firsts = itertools.accumulate(lengths, initial=0)
        tokens = [[(_SPREAD * (first + j)) % vocab_size for j in range(n)] for first, n in zip(firsts, lengths)]
        try:
            seconds = []
            for _ in range(3):  # the first run warms caches and allocator; the least of the others counts
                started = clock(device)
                forward(layout, tokens)
                seconds.append(clock(device) - started)
                for request in ids:
                    free(request)
        except KVCacheError:
            break
        finally:
            for request in ids:
                free(request)
        controller.target_seconds.calibrate(layout.num_rows, min(seconds[1:]))
        measured = layout.num_rows


def calibration_sizes(k: int, max_rows: int) -> list[int]:
    """The row counts calibration times: every one up to ``k + 1`` (what one request's step can be), the
    powers of two past it, and the largest step itself (``max_rows``), all at most
    :data:`CALIBRATION_MAX_ROWS`. Every size a lone request can choose gets a calibrated point, and
    the largest gets one rather than being extrapolated: a size priced only by its first observed
    step keeps that step's price until a probe re-measures it (at concurrency 1 with k=5, a first
    6-row step read 1.5x what 6 rows cost)."""
    last = min(max_rows, CALIBRATION_MAX_ROWS)
    doubling = itertools.takewhile(lambda rows: rows < last, (2 ** i for i in itertools.count()))
    return sorted({*range(1, min(k + 1, last) + 1), *doubling, last})
