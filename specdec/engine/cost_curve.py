"""Seconds against a size, learned while the engine runs: what the adaptive controller
(:mod:`specdec.engine.goodput`) prices a step's parts with."""

from __future__ import annotations

import bisect
import statistics
from typing import Sequence

# A cost curve's observed point weighs as many observations as it has had, up to this many (older
# ones have faded from its moving average).
MAX_WEIGHT = 8


class CostCurve:
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
        self.smoothing = smoothing
        self.borrowed_shape = borrowed_shape
        self.points: dict[int, float] = {}  # observed
        self.weights: dict[int, int] = {}  # observations behind each observed point, up to MAX_WEIGHT
        self.num_observed = 0  # observations at every size, all of them
        self.calibrated: dict[int, float] = {}
        self._curve: tuple[list[int], list[float]] | None = None  # sizes and fitted costs, when read

    def observe(self, size: int, seconds: float) -> None:
        old = self.points.get(size)
        self.points[size] = seconds if old is None else old + self.smoothing * (seconds - old)
        self.weights[size] = min(self.weights.get(size, 0) + 1, MAX_WEIGHT)
        self.num_observed += 1
        self._curve = None

    def calibrate(self, size: int, seconds: float) -> None:
        self.calibrated[size] = seconds
        self._curve = None

    def __call__(self, size: int) -> float:
        return self.over(size, size)[0]

    def over(self, first: int, last: int) -> list[float]:
        """The costs of sizes ``first..last`` (a step's choice reads many, every step: plain Python,
        which at these few points and sizes costs a fraction of numpy's per-call overhead)."""
        xs, ys = self._read()
        sizes = range(first, last + 1)
        if not xs:
            return [0.0] * len(sizes)
        if len(xs) == 1:
            return [ys[0] * n / xs[0] for n in sizes]  # proportional until a second point exists
        # The segment each size reads: the one it lies in, or the first / last one past the ends.
        segment, end = min(max(bisect.bisect_right(xs, first) - 1, 0), len(xs) - 2), len(xs) - 2
        costs = []
        for n in sizes:
            while segment < end and n > xs[segment + 1]:
                segment += 1
            x0, y0, x1, y1 = xs[segment], ys[segment], xs[segment + 1], ys[segment + 1]
            costs.append(max(y0 + (y1 - y0) * (n - x0) / (x1 - x0), 0.0))
        return costs

    def level(self) -> float:
        """How observed costs compare with calibrated ones at the sizes both have (1 when none do)."""
        both = [self.points[n] / self.calibrated[n] for n in self.points.keys() & self.calibrated.keys()
                if self.calibrated[n] > 0]
        return statistics.median(both) if both else 1.0

    def _read(self) -> tuple[list[int], list[float]]:
        if self._curve is None and self.borrowed_shape and not self.points:
            self._curve = [], []  # another forward's costs: no price of this one yet
        if self._curve is None:
            scale = self.level()
            merged = {n: (c * scale, 1) for n, c in self.calibrated.items()}
            merged |= {n: (c, self.weights[n]) for n, c in self.points.items()}
            sizes = sorted(merged)
            self._curve = sizes, non_decreasing_fit([merged[n][0] for n in sizes], [merged[n][1] for n in sizes])
        return self._curve

    def state(self) -> tuple:
        return tuple(self.points.items()), tuple(self.weights.items()), tuple(self.calibrated.items()), self.num_observed

    def load(self, state) -> None:
        points, weights, calibrated, self.num_observed = state
        self.points, self.weights, self.calibrated = dict(points), dict(weights), dict(calibrated)
        self._curve = None


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
