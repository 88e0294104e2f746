"""The adaptive controller's starting target and draft curves: forwards of growing size timed when the
engine starts (:func:`calibrate`), on throwaway requests, before any step has measured them."""

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
    draft_step: Callable[[list[Hashable]], bool] | None = None,
) -> None:
    """Time target forwards laid out like decode steps (:func:`calibration_layouts`: requests of 1 row,
    and of 1 + k rows, at most ``max_requests`` of them and ``max_rows`` rows), on throwaway requests
    freed after: the target's cost's first points, by rows and requests (:class:`ForwardCost`). Stops
    early when the KV cache cannot hold a layout (the costs extrapolate from there). Then, given the
    proposer's ``draft_step`` (its ``calibration_step``), the same for the draft curve by requests
    (:func:`_calibrate_draft`).

    The rows carry distinct token ids spread over the vocabulary: a mixture of experts routes equal
    tokens to the same few experts, and a forward of one token repeated would price its rows like a
    small dense model's (on the zoo MiniMax-M3, 128 rows cost 2x one row with one token repeated,
    2.5-3x with distinct ones)."""
    device = controller.device
    for requests, length in calibration_layouts(controller.k, max_requests, max_rows):
        ids = [(_CALIBRATION_REQUEST, i) for i in range(requests)]
        layout = StepLayout.build(ids, [0] * requests, [length] * requests, [length - 1] * requests, device)
        tokens = [[(_SPREAD * (length * i + j)) % vocab_size for j in range(length)] for i in range(requests)]
        seconds = _least_time(lambda: forward(layout, tokens), ids, free, device)
        if seconds is None:
            break
        controller.target_seconds.calibrate(layout.num_rows, requests, seconds)
    if draft_step is not None:
        _calibrate_draft(controller, draft_step, free, max_requests)


def _calibrate_draft(controller: GoodputController, draft_step: Callable[[list[Hashable]], bool],
                     free: Callable[[Hashable], None], max_requests: int) -> None:
    """Time one step of the draft chain over :func:`calibration_sizes` requests, up to ``max_requests``:
    the draft curve's shape by requests, at the level the drafting steps measure (a chain's step here
    reads no context, and a step's catch-up runs more rows). Without it the curve extrapolated from
    the sizes drafted at, in proportion from one: after serving one request at a time on the zoo
    MiniMax-M3 pair it priced a 16-request draft forward at 16 x 1.6 ms where it takes 3.1, and the
    model gave concurrency 16 no drafts."""
    for requests in calibration_sizes(controller.k, max_requests):
        ids = [(_CALIBRATION_REQUEST, i) for i in range(requests)]
        ran = []
        seconds = _least_time(lambda: ran.append(draft_step(ids)), ids, free, controller.device)
        if seconds is None or not all(ran):
            return  # the cache cannot hold the size, or the proposer has no forward to time
        controller.draft_seconds.calibrate(requests, seconds)
        # Keeping a request's draft state is a small dense pass over its new rows too (the draft's fc
        # over the target's states, and bookkeeping): it borrows the shape (:class:`CostCurve`).
        controller.keep_seconds.calibrate(requests, seconds)


def _least_time(run: Callable[[], object], ids: list[Hashable], free: Callable[[Hashable], None],
                device) -> float | None:
    """Seconds ``run`` takes over throwaway requests ``ids``, freed after each run: the least of the
    second and third runs (the first warms caches and allocator); None when the KV cache cannot hold them."""
    seconds = []
    for _ in range(3):
        started = clock(device)
        try:
            run()
            seconds.append(clock(device) - started)
        except KVCacheError:
            return None
        finally:
            for request in ids:
                free(request)
    return min(seconds[1:])


def calibration_sizes(k: int, max_size: int) -> list[int]:
    """The sizes (requests, or rows) calibration times: every one up to ``k + 1`` (the rows one request's
    step can run), the powers of two past it, and ``max_size`` itself, all at most
    :data:`CALIBRATION_MAX_ROWS`. The largest gets a point rather than being extrapolated: a size priced
    only by its first observed step keeps that step's price until a probe re-measures it (at concurrency
    1 with k=5, a first 6-row step read 1.5x what 6 rows cost)."""
    last = min(max_size, CALIBRATION_MAX_ROWS)
    doubling = itertools.takewhile(lambda size: size < last, (2 ** i for i in itertools.count()))
    return sorted({*range(1, min(k + 1, last) + 1), *doubling, last})


def calibration_layouts(k: int, max_requests: int, max_rows: int) -> list[tuple[int, int]]:
    """The target forwards calibration times, as (requests, rows each): one request at every length up
    to ``1 + k`` (every step a lone request can choose), and :func:`calibration_sizes` requests of 1 row
    (a plain step) and of ``1 + k`` (every draft), at most ``max_rows`` rows: both ends of each load's
    choice, which sets apart what a forward's rows cost and what its requests do (:class:`ForwardCost`)."""
    rows = min(max_rows, CALIBRATION_MAX_ROWS)
    lone = [(1, length) for length in range(1, k + 2)]
    loads = [(n, length) for n in calibration_sizes(k, max_requests)[1:] for length in (1, k + 1)]
    return [(n, length) for n, length in lone + loads if n * length <= rows]
