"""The adaptive controller's cost curves: interpolation, extrapolation, the non-decreasing fit,
calibrated points scaled to the observed level."""

from __future__ import annotations

import pytest

from specdec.engine.cost_curve import CostCurve, ForwardCost


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


def test_a_borrowed_shape_prices_nothing_until_observed_then_extrapolates_along_it():
    curve = CostCurve(borrowed_shape=True)  # keeping draft state, shaped like the draft chain's step
    for requests, seconds in ((1, 1.0), (2, 1.0), (4, 1.2), (16, 2.0), (32, 3.0)):
        curve.calibrate(requests, seconds)
    assert curve(1) == curve(16) == 0.0  # another forward's costs: nothing known of this one yet
    curve.observe(1, 0.5)  # keeping one request's state (an engine that has served one at a time)
    assert curve(16) == pytest.approx(1.0)  # along the shape at level 0.5, not 16 x 0.5 in proportion
    for requests, seconds in ((2, 0.5), (4, 0.9)):  # a slowish step at 4 requests
        curve.observe(requests, seconds)
    # Median level 0.5: 32 requests cost the shape's 3.0 at it, not the 6.5 that the slope of the last
    # two observed points (0.2 a request from 2 to 4) reaches without a shape.
    assert curve(32) == pytest.approx(1.5)
    unshaped = CostCurve()
    for requests, seconds in ((1, 0.5), (2, 0.5), (4, 0.9)):
        unshaped.observe(requests, seconds)
    assert unshaped(32) == pytest.approx(6.5)
    plain = CostCurve()
    plain.load(curve.state())
    assert plain(32) == pytest.approx(1.5)  # what differs is only the price before an observation
    assert CostCurve(borrowed_shape=False).over(1, 2) == [0.0, 0.0]


def test_a_forward_s_cost_is_fitted_as_a_part_by_rows_and_a_part_by_requests():
    by_rows = {1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0, 16: 18.0, 32: 26.0, 64: 40.0}
    by_requests = {1: 0.0, 4: 3.0, 16: 12.0}
    cost = ForwardCost()
    assert cost(8, 4) == 0.0  # nothing measured: free
    for (rows, requests) in ((1, 1), (4, 1), (4, 4), (16, 4), (16, 16), (64, 16)):
        cost.observe(rows, requests, by_rows[rows] + by_requests[requests])
    # Sixteen rows cost more from sixteen requests than from four; the parts come back exactly.
    assert cost(16, 4) == pytest.approx(21.0) and cost(16, 16) == pytest.approx(30.0)
    assert cost(64, 4) == pytest.approx(43.0)  # never run: 64 rows' part and 4 requests' part
    assert cost(8, 8) == pytest.approx(14.0 + 6.0)  # between points, each part interpolates
    copy = ForwardCost()
    copy.load(cost.state())
    assert [copy(r, n) for r, n in ((1, 1), (16, 16), (40, 10))] == [cost(r, n) for r, n in ((1, 1), (16, 16), (40, 10))]
    # At one request count only, it is a curve by rows.
    rows_only = ForwardCost()
    for rows in (1, 2, 4):
        rows_only.observe(rows, 1, by_rows[rows])
    assert [rows_only(rows, 3) for rows in (1, 2, 3, 4)] == pytest.approx([10.0, 11.0, 11.5, 12.0])


def test_a_forward_s_calibration_gives_both_parts_shapes_and_steps_their_level():
    cost = ForwardCost()
    for rows, requests, seconds in ((1, 1, 1.0), (4, 1, 2.0), (4, 4, 3.0), (16, 4, 4.0)):
        cost.calibrate(rows, requests, seconds)
    cost.observe(4, 4, 6.0)  # the engine's own steps cost 2x the context-free calibration
    assert cost.level() == 2.0
    assert cost(16, 4) == pytest.approx(8.0) and cost(4, 1) == pytest.approx(4.0)
    # Each part non-decreasing: a cheap reading at more requests is pooled, never made a discount.
    cost.observe(4, 1, 7.0)
    assert cost(4, 4) >= cost(4, 1)
