"""The adaptive controller's cost curves: interpolation, extrapolation, the non-decreasing fit,
calibrated points scaled to the observed level."""

from __future__ import annotations

import pytest

from specdec.engine.cost_curve import CostCurve


def test_cost_curve_interpolates_bounds_outliers_and_extrapolates():
    curve = CostCurve(smoothing=0.5)
    assert curve(10) == 0.0  # nothing measured: free
    curve.observe(4, 2.0)
    assert curve(8) == 4.0  # one point: proportional
    curve.observe(8, 3.0)
    curve.observe(16, 5.0)
    assert curve(12) == pytest.approx(4.0)  # between 8 and 16
    assert curve(32) == pytest.approx(9.0)  # past the end, along the last segment
    assert curve(1) == pytest.approx(1.25)  # before the start, along the first segment
    assert CostCurve.__call__(curve, 0) >= 0.0
    curve.observe(8, 9.0)  # a slow outlier: the average moves halfway, to 6.0 ...
    assert curve.points[8] == pytest.approx(6.0)
    # ... but 8 rows never cost more than 16: the two are pooled, 8 weighing its two observations.
    assert curve(8) == curve(16) == pytest.approx((2 * 6.0 + 5.0) / 3)
    copy = CostCurve()
    copy.load(curve.state())
    assert [copy(n) for n in (1, 8, 12, 40)] == [curve(n) for n in (1, 8, 12, 40)]
    assert copy.num_observed == curve.num_observed == sum(curve.weights.values())  # none past MAX_WEIGHT here


def test_a_cheap_outlier_does_not_price_every_smaller_size():
    curve = CostCurve()
    for size in (10, 20, 30):
        for _ in range(4):
            curve.observe(size, float(size))
    curve.observe(40, 5.0)  # one lucky step (short contexts, a quiet machine)
    assert [curve(n) for n in (10, 20)] == [10.0, 20.0]
    assert curve(30) == curve(40) == pytest.approx((4 * 30.0 + 5.0) / 5)  # averaged with its neighbour, by weight


def test_calibration_gives_the_shape_and_steps_the_level():
    curve = CostCurve()
    for rows, seconds in ((8, 1.0), (32, 2.0), (128, 6.0)):
        curve.calibrate(rows, seconds)  # context-free forwards: too cheap
    assert curve(128) == 6.0 and curve.level() == 1.0
    curve.observe(32, 5.0)  # the engine's own 32-row steps cost 2.5x the calibration
    assert curve.level() == 2.5
    assert curve(128) == pytest.approx(15.0)  # never run at 128 rows: the calibrated shape, scaled
    assert curve(32) == 5.0 and curve(8) == pytest.approx(2.5)
    curve.observe(128, 12.0)  # a size measured for itself speaks for itself
    assert curve(128) == 12.0 and curve.level() == pytest.approx(2.25)
    copy = CostCurve()
    copy.load(curve.state())
    assert [copy(n) for n in (8, 20, 128, 300)] == [curve(n) for n in (8, 20, 128, 300)]
