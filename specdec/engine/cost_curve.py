"""Seconds against a size, learned while the engine runs: what the adaptive controller
(:mod:`specdec.engine.goodput`) prices a step's parts with."""

from __future__ import annotations

import bisect
import statistics
from typing import Sequence

# A cost curve's observed point weighs as many observations as it has had, up to this many (older
# ones have faded from its moving average).
MAX_WEIGHT = 8


class MeasuredPoints:
    """What a cost is fitted to: observed points (each an exponential moving average, weighing as many
    observations as it has had, up to :data:`MAX_WEIGHT`) and calibrated ones, by a key (a size, or rows
    and requests), and the calibration's scale (:meth:`level`). Subclasses fit them when read (``_fit``)
    and refit after any change (``_fresh``)."""

    def __init__(self, smoothing: float = 0.25):
        self.smoothing = smoothing
        self.points: dict = {}  # observed
        self.weights: dict = {}  # observations behind each observed point, up to MAX_WEIGHT
        self.num_observed = 0  # observations at every key, all of them
        self.calibrated: dict = {}
        self._fit = None  # the last fit, current while _fresh
        self._fresh = False

    def _observe(self, key, seconds: float) -> None:
        old = self.points.get(key)
        self.points[key] = seconds if old is None else old + self.smoothing * (seconds - old)
        self.weights[key] = min(self.weights.get(key, 0) + 1, MAX_WEIGHT)
        self.num_observed += 1
        self._fresh = False

    def _calibrate(self, key, seconds: float) -> None:
        self.calibrated[key] = seconds
        self._fresh = False

    def level(self) -> float:
        """How observed costs compare with calibrated ones where both exist (1 where none do)."""
        both = [self.points[key] / self.calibrated[key] for key in self.points.keys() & self.calibrated.keys()
                if self.calibrated[key] > 0]
        return statistics.median(both) if both else 1.0

    def _merged(self) -> dict:
        """Every point as (seconds, weight): calibrated ones at the observed level, weighing one
        observation, unless observed."""
        scale = self.level()
        merged = {key: (c * scale, 1) for key, c in self.calibrated.items()}
        return merged | {key: (c, self.weights[key]) for key, c in self.points.items()}

    def _points_state(self) -> tuple:
        return tuple(self.points.items()), tuple(self.weights.items()), tuple(self.calibrated.items()), self.num_observed

    def _load_points(self, state: tuple) -> None:
        points, weights, calibrated, self.num_observed = state
        self.points, self.weights, self.calibrated = dict(points), dict(weights), dict(calibrated)
        self._fresh = False


class CostCurve(MeasuredPoints):
    """Seconds against a size (rows in a forward, requests in a draft forward).

    Two kinds of points. *Observed* ones are what the running engine measured at a size, each an
    exponential moving average. *Calibrated* ones (:meth:`calibrate`) were timed before serving, on
    throwaway requests with no context, so they have the right shape but not the right level: where a
    size has no observation of its own, its calibrated cost is scaled by how the observations compare
    with the calibration where both exist (the median ratio). So a load the engine has never run at
    (a step with more drafts than any so far) is priced from the calibrated shape at today's level.

    Reading assumes that more work never takes less time: the points are fitted by the closest
    non-decreasing costs (least squares, each observed size weighted by how often it was observed, up
    to :data:`MAX_WEIGHT`: pooled adjacent violators), so an outlier, a step that met a busy machine or
    a size seen only at short contexts, is averaged with its neighbours rather than believed (which
    would make its size dearer than bigger ones) or made a bound (which would price every smaller size
    at one lucky step). Between sizes it interpolates linearly, past the ends it follows the nearest
    segment (never below zero).

    ``borrowed_shape``: the calibration is another forward's shape, not this curve's cost (the keeping
    curve takes the draft chain's step, timed by requests). Until it has observed a point such a curve
    prices nothing, as a curve without calibration does; once it has, sizes past the ones observed
    follow the borrowed shape at the observed level, rather than the slope of the last two observed
    points, which a few noisy points at small sizes make steep, or the proportion of a single point."""

    def __init__(self, smoothing: float = 0.25, borrowed_shape: bool = False):
        super().__init__(smoothing)
        self.borrowed_shape = borrowed_shape

    def observe(self, size: int, seconds: float) -> None:
        self._observe(size, seconds)

    def calibrate(self, size: int, seconds: float) -> None:
        self._calibrate(size, seconds)

    def __call__(self, size: int) -> float:
        return self.over(size, size)[0]

    def over(self, first: int, last: int) -> list[float]:
        """The costs of sizes ``first..last`` (a step's choice reads many, every step: plain Python,
        which at these few points and sizes costs a fraction of numpy's per-call overhead)."""
        return interpolate(*self._read(), first, last)

    def _read(self) -> tuple[list[int], list[float]]:
        """The sizes and their fitted costs."""
        if not self._fresh:
            if self.borrowed_shape and not self.points:
                self._fit = [], []  # another forward's costs: no price of this one yet
            else:
                merged = self._merged()
                sizes = sorted(merged)
                self._fit = sizes, non_decreasing_fit([merged[n][0] for n in sizes], [merged[n][1] for n in sizes])
            self._fresh = True
        return self._fit

    def state(self) -> tuple:
        return self._points_state()

    def load(self, state) -> None:
        self._load_points(state)


class ForwardCost(MeasuredPoints):
    """Seconds of a forward against its rows and its requests: a part by rows plus a part by requests.

    Rows alone price a forward by its arithmetic, but a forward also pays for each request in it: its
    attention over its own context, gathering its pages, and in a mixture of experts the routing (one
    request's rows follow one text and share experts more than rows of different texts). On the zoo
    MiniMax-M3 target (bf16, one thread, contexts of 96 tokens) 16 rows took 26 ms as 4 requests of 4
    and 37 ms as 16 of 1; 32 rows 36 ms as 4 of 8 and 45 ms as 32 of 1. A curve by rows alone, learnt
    at concurrency 4 (steps of up to 16 rows), priced a plain step of 16 requests 24% cheap, so drafting
    at concurrency 16 seemed not to pay where a fixed k=3 served 1.33x of none.

    Points are kept per (rows, requests) as :class:`CostCurve` keeps them per size, observed ones as
    moving averages and calibrated ones scaled to the observed level (:meth:`level`). The two parts are
    the additive fit closest to them in weighted least squares, each non-decreasing, the part by
    requests zero at the fewest requests seen: each part is fitted in turn to what the other leaves
    (backfitting, pooled adjacent violators for each), starting from the last fit's part by requests,
    which one new point moves little. Both parts interpolate and extrapolate as :class:`CostCurve`
    does; with points at one request count only, the part by requests is zero: a curve by rows."""

    def observe(self, rows: int, requests: int, seconds: float) -> None:
        self._observe((rows, requests), seconds)

    def calibrate(self, rows: int, requests: int, seconds: float) -> None:
        self._calibrate((rows, requests), seconds)

    def __call__(self, rows: int, requests: int) -> float:
        return self.over(rows, rows, requests)[0]

    def over(self, first: int, last: int, requests: int) -> list[float]:
        """The costs of ``first..last`` rows over ``requests`` requests."""
        rows, by_rows, counts, by_requests = self._read()
        surcharge = interpolate(counts, by_requests, requests, requests)[0]  # zero at one request count
        return [max(cost + surcharge, 0.0) for cost in interpolate(rows, by_rows, first, last)]

    def _read(self) -> tuple[list[int], list[float], list[int], list[float]]:
        """Rows and their part, request counts and theirs; refitted from the last fit's part by requests."""
        if not self._fresh:
            start = dict(zip(self._fit[2], self._fit[3])) if self._fit else {}
            by_rows, by_requests = additive_fit(self._merged(), start)
            self._fit = (sorted(by_rows), [by_rows[n] for n in sorted(by_rows)],
                         sorted(by_requests), [by_requests[n] for n in sorted(by_requests)])
            self._fresh = True
        return self._fit

    def state(self) -> tuple:
        """The points and their fit: a fit goes on from the last one (:func:`additive_fit`), so a copy
        refitting the same points from elsewhere could price a step differently (under tensor
        parallelism, ranks would choose apart)."""
        return self._points_state(), self._read()

    def load(self, state) -> None:
        points, self._fit = state
        self._load_points(points)
        self._fresh = True


def interpolate(xs: Sequence[int], ys: Sequence[float], first: int, last: int) -> list[float]:
    """The values at ``first..last`` of the piecewise-linear function through points ``xs``, ``ys`` (sizes
    increasing): between points linear, past the ends along the nearest segment, never below zero; with
    one point, in proportion to it; with none, zero."""
    sizes = range(first, last + 1)
    if not xs:
        return [0.0] * len(sizes)
    if len(xs) == 1:
        return [ys[0] * n / xs[0] for n in sizes]
    # The segment each size reads: the one it lies in, or the first / last one past the ends.
    segment, end = min(max(bisect.bisect_right(xs, first) - 1, 0), len(xs) - 2), len(xs) - 2
    values = []
    for n in sizes:
        while segment < end and n > xs[segment + 1]:
            segment += 1
        x0, y0, x1, y1 = xs[segment], ys[segment], xs[segment + 1], ys[segment + 1]
        values.append(max(y0 + (y1 - y0) * (n - x0) / (x1 - x0), 0.0))
    return values


def non_decreasing_fit(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in weighted least squares (pool adjacent
    violators: a value below the one before it is merged with it into their weighted mean, repeatedly)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for value, weight in zip(values, weights):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight, length = blocks.pop()
            last = blocks[-1]
            total = last[1] + weight
            last[0] = (last[0] * last[1] + mean * weight) / total
            last[1], last[2] = total, last[2] + length
    return [mean for mean, _, length in blocks for _ in range(length)]


# Backfitting stops when no part by requests moves more than FIT_TOLERANCE seconds, or after FIT_ROUNDS
# rounds from scratch, WARM_ROUNDS from a previous fit at the same request counts: a step's new point
# moves the fit little, and the next step's fit goes on from there (each round is two passes over the
# points, every step).
FIT_TOLERANCE = 1e-7
FIT_ROUNDS = 64
WARM_ROUNDS = 3


def additive_fit(points: dict[tuple[int, int], tuple[float, float]],
                 by_requests: dict[int, float]) -> tuple[dict[int, float], dict[int, float]]:
    """Non-decreasing parts by rows and by requests whose sum is closest to ``points`` ((rows, requests)
    -> (seconds, weight)) in weighted least squares, the part by requests zero at the fewest requests,
    by backfitting from ``by_requests`` (a previous fit's part, or empty) (:class:`ForwardCost`)."""
    rows = sorted({r for r, _ in points})
    counts = sorted({n for _, n in points})
    row_index = {r: i for i, r in enumerate(rows)}
    count_index = {n: i for i, n in enumerate(counts)}
    keys = [(row_index[r], count_index[n]) for r, n in points]
    seconds = [value for value, _ in points.values()]
    weights = [weight for _, weight in points.values()]
    row_weights, count_weights = [0.0] * len(rows), [0.0] * len(counts)
    for (i, j), weight in zip(keys, weights):
        row_weights[i] += weight
        count_weights[j] += weight

    def fit(axis: int, other: list[float], size_weights: list[float]) -> list[float]:
        sums = [0.0] * len(size_weights)  # weighted residuals per size
        for key, value, weight in zip(keys, seconds, weights):
            sums[key[axis]] += weight * (value - other[key[1 - axis]])
        return non_decreasing_fit([total / weight for total, weight in zip(sums, size_weights)], size_weights)

    surcharge = [by_requests.get(n, 0.0) for n in counts]
    warm = all(n in by_requests for n in counts)  # a request count new to the fit starts from scratch
    for _ in range(WARM_ROUNDS if warm else FIT_ROUNDS):
        by_rows = fit(0, surcharge, row_weights)
        fitted = fit(1, by_rows, count_weights)
        fitted = [cost - fitted[0] for cost in fitted]
        moved = max((abs(a - b) for a, b in zip(fitted, surcharge)), default=0.0)
        surcharge = fitted
        if moved <= FIT_TOLERANCE:
            break
    return dict(zip(rows, fit(0, surcharge, row_weights))), dict(zip(counts, surcharge))
