"""The acceptance estimates the adaptive controller weighs drafts with: conditional per position,
shrunk towards the engine-wide rate, a position never offered taking the rate of the one before."""

from __future__ import annotations

import pytest

from specdec.engine.acceptance_estimates import AcceptanceEstimates, conditional_rates


def test_acceptance_estimates_are_conditional_and_shrunk_to_the_engine_rate():
    estimates = AcceptanceEstimates(3, prior=0.5)
    assert estimates.rates("a") == [0.5, 0.5, 0.5]
    for _ in range(30):
        estimates.observe("a", 3, 3)  # every draft accepted
        estimates.observe("b", 3, 0)  # the first refused: positions 2 and 3 never reached
    a, b = estimates.rates("a"), estimates.rates("b")
    assert all(r > 0.8 for r in a)
    assert b[0] < 0.2
    assert b[1] == pytest.approx(estimates.engine_rates()[1])  # no evidence of its own there
    estimates.forget("a")
    assert estimates.rates("a") == estimates.engine_rates()


def test_a_position_never_offered_takes_the_rate_of_the_one_before():
    # Drafts beyond the first are offered only when they are expected to pay: a constant prior there
    # (0.6 here) would keep a draft accepted this often from being offered a second draft at all.
    estimates = AcceptanceEstimates(3, prior=0.6)
    for _ in range(100):
        estimates.observe("r", 1, 1)  # one draft a step, always accepted
    rates = estimates.engine_rates()
    assert rates[0] > 0.95 and rates == [rates[0]] * 3
    for _ in range(100):
        estimates.observe("r", 3, 1)  # the second now offered, and always refused
    assert estimates.engine_rates()[1] < 0.1
    assert estimates.engine_rates()[2] == pytest.approx(estimates.engine_rates()[1])  # still never reached


def test_a_draft_s_recorded_acceptance_is_the_prior_and_a_few_refusals_do_not_make_it_useless():
    recorded = (0.8, 0.6, 0.45)  # shares of drafts accepted at each position, as a checkpoint records them
    assert conditional_rates(recorded) == pytest.approx((0.8, 0.75, 0.75))
    estimates, guessed = AcceptanceEstimates(3, recorded=recorded), AcceptanceEstimates(3)
    assert estimates.engine_rates() == pytest.approx([0.8, 0.75, 0.75])
    for counts in (estimates, guessed):
        for _ in range(3):  # one hard prompt's first drafts, all refused
            counts.observe("hard", 3, 0)
    assert estimates.engine_rates()[0] > 0.7  # the record still weighs
    assert guessed.engine_rates()[0] < 0.4  # a guessed prior does not (INITIAL_ACCEPTANCE)
    assert estimates.evidence() == pytest.approx(3 + 32, abs=0.1)  # a record is evidence (RECORD_WEIGHT drafts) ...
    assert guessed.evidence() == pytest.approx(3, abs=0.1)  # ... a guess is not (counts fade a little)
    for _ in range(300):  # the workload's own drafts take over: here it accepts less than recorded
        estimates.observe("r", 3, 1)
    assert estimates.engine_rates()[0] > 0.95 and estimates.engine_rates()[1] < 0.2
