"""The adaptive draft controller (``adaptive`` in the speculative config).

- Its parts (the cost curves: tests/engine/test_cost_curve.py; the acceptance estimates:
  tests/engine/test_acceptance_estimates.py), and its choices on planted costs and
  acceptance: all drafts when rows are free, none when drafts cost more than they bring, more drafts
  for the requests that are accepted more, dormancy for a request left idle or admitted where drafts
  do not pay.
- Through the engine: tests/engine/test_goodput_lossless.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from specdec.engine.cost_curve import CostCurve, ForwardCost
from specdec.engine.goodput import (
    ADMIT_GAIN,
    DORMANT_MAX_DRAFTING,
    DORMANT_WINDOW,
    MIN_EVIDENCE,
    MIN_TIMED_DRAFT_STEPS,
    PROBE_EVERY,
    PROBE_STEPS,
    STEP_GAIN,
    GoodputController,
    _chain,
)
from specdec.runtime.layout import StepLayout


# ----------------------------------------------------------------------------- parts
def _controller(k: int, target, draft, acceptance: dict) -> GoodputController:
    """A controller with planted costs (``target(rows)``, ``draft(requests)`` per forward, seconds; the
    target's planted at one request count: a cost by rows alone, whatever the requests) and
    acceptance (request -> its observed accept pattern, repeated)."""
    controller = GoodputController(k)
    for rows in (1, 2, 4, 8, 16, 32, 64, 128):
        controller.target_seconds.observe(rows, 1, target(rows))
    for _ in range(-(-MIN_TIMED_DRAFT_STEPS // 6)):  # enough timed steps that the price is trusted (no probe)
        for requests in (1, 2, 4, 8, 16, 32):
            controller.draft_seconds.observe(requests, draft(requests))
    for request, accepted in acceptance.items():
        for _ in range(40):
            controller.observe_verified(request, k, accepted)
    return controller


def test_free_rows_and_free_drafts_get_every_draft():
    controller = _controller(4, lambda rows: 1.0, lambda n: 0.0, {r: 2 for r in range(8)})
    assert controller.choose(list(range(8)), [4] * 8, base_rows=8) == [4] * 8
    assert controller.choose([0, 1], [2, 0], base_rows=2) == [2, 0]  # never past a cap


def test_drafts_that_cost_more_than_they_bring_get_none():
    # Rows cost in proportion, a draft forward as much as a target row's share, and little is accepted.
    controller = _controller(3, lambda rows: 0.01 * rows, lambda n: 0.01 * n, {r: 0 for r in range(16)})
    assert controller.choose(list(range(16)), [3] * 16, base_rows=16) == [0] * 16


def test_requests_accepted_more_get_more_drafts():
    # A forward's time grows with its rows; drafts themselves are cheap.
    controller = _controller(3, lambda rows: 0.01 + 0.004 * rows, lambda n: 0.0001,
                             {"good": 3, "fair": 1, "poor": 0})
    chosen = dict(zip(["good", "fair", "poor"], controller.best_counts(["good", "fair", "poor"], [3, 3, 3], base_rows=3)))
    assert chosen["good"] == 3
    assert chosen["good"] > chosen["fair"] >= chosen["poor"]
    assert chosen["poor"] == 0


def test_a_step_s_fixed_costs_make_drafts_pay():
    # Rows cost in proportion and drafts are cheap; every request's first draft is accepted and its
    # second refused. With nothing else in a step a draft's row costs more than it brings (a row's share
    # of the step against a token short of one); a second of other work per step (the sampler,
    # bookkeeping: what a request costs whatever its drafts) tips the balance to the first drafts.
    controller = _controller(3, lambda rows: 0.1 * rows, lambda n: 0.001, {r: 1 for r in range(4)})
    assert controller.best_counts(list(range(4)), [3] * 4, base_rows=4) == [0] * 4
    controller.other_seconds.observe(4, 1.0)
    assert controller.best_counts(list(range(4)), [3] * 4, base_rows=4) == [1] * 4


def test_a_load_is_priced_at_its_requests_not_at_the_rows_fewer_requests_ran():
    # A forward costs a part by rows and a part by requests: 16 rows from 4 requests take 20 ms, from 16
    # requests 30 ms. Steps at concurrency 4 ran up to 16 rows; 16 and 64 rows from 16 requests were
    # only calibrated. A plain step of 16 requests is priced at its requests, not at what 4 requests'
    # 16 rows took (a curve by rows alone took the steps' word for 16 rows, whoever ran them).
    def cost(rows: int, requests: int) -> float:
        return 0.01 + 0.0005 * rows + 0.0008 * (requests - 1)

    controller = GoodputController(3)
    for rows, requests in ((16, 16), (64, 16)):
        controller.target_seconds.calibrate(rows, requests, cost(rows, requests))
    for rows in range(4, 17):
        controller.target_seconds.observe(rows, 4, cost(rows, 4))
    for _ in range(MIN_TIMED_DRAFT_STEPS):
        controller.draft_seconds.observe(16, 0.001)
    for request in range(16):
        for _ in range(10):
            controller.observe_verified(request, 3, 3)
    assert controller.target_seconds(16, 16) == pytest.approx(cost(16, 16), rel=1e-4)
    assert controller.target_seconds(16, 4) == pytest.approx(cost(16, 4), rel=1e-4)
    assert controller.speculation_pays(16)
    assert controller.choose(list(range(16)), [3] * 16, base_rows=16) == [3] * 16


def test_requests_admitted_where_drafts_do_not_pay_start_dormant():
    # Forwards cost the same up to 8 rows, then grow in proportion; drafts are cheap and mostly accepted.
    controller = _controller(3, lambda rows: max(0.02, 0.0025 * rows), lambda n: 0.0001, {"seen": 3})
    assert controller.speculation_pays(2) and not controller.speculation_pays(16)
    busy = [f"busy{i}" for i in range(16)]
    assert controller.choose(busy, [3] * 16, base_rows=16) == [0] * 16
    assert all(map(controller.is_dormant, busy))  # no state kept for DORMANT_WINDOW steps to learn it
    assert controller.choose(busy[:2], [3, 3], base_rows=2) == [0, 0]  # the load fell: they stay dormant ...
    assert controller.choose(["new", *busy[:1]], [3, 3], base_rows=2) == [3, 0]  # ... a request admitted now drafts
    assert not controller.is_dormant("new")
    # Keeping draft states ready costs every step, drafting or not: dear enough, it outweighs the drafts.
    controller.keep_seconds.observe(2, 0.1)
    assert not controller.speculation_pays(2)


def test_a_request_admitted_beside_dormant_ones_starts_as_it_would_draft_among_them():
    # Rows are nearly free up to 16, then cost in proportion; a draft forward costs the same over any
    # number of requests (its overhead), so the chain pays when several requests share it.
    controller = _controller(3, lambda rows: max(0.01 + 0.0005 * rows, 0.0025 * rows - 0.022), lambda n: 0.004,
                             {"seen": 3})
    assert controller.speculation_pays(4) and not controller.speculation_pays(4, num_dormant=3)
    busy = [f"busy{i}" for i in range(16)]
    assert controller.choose(busy, [3] * 16, base_rows=16) == [0] * 16  # past 16 rows drafts do not pay
    assert all(map(controller.is_dormant, busy))
    # The load falls to 4, 3 of them dormant: drafting alone the newcomer would get no drafts (the
    # step's choice says so too), so it starts dormant rather than keeping draft state for nothing.
    assert controller.best_counts(["new", *busy[:3]], [3, 0, 0, 0], base_rows=4) == [0] * 4
    assert controller.choose(["new", *busy[:3]], [3] * 4, base_rows=4) == [0] * 4
    assert controller.is_dormant("new")
    # With the dormant ones gone, 4 requests admitted together draft.
    fresh = [f"fresh{i}" for i in range(4)]
    assert all(controller.choose(fresh, [3] * 4, base_rows=4))


class Running:
    """What :meth:`GoodputController.to_wake` reads of a running request."""

    is_finished = False

    def __init__(self, seq_id, num_tokens, max_len):
        self.seq_id, self.num_tokens, self.max_len = seq_id, num_tokens, max_len


def test_dormant_requests_are_woken_once_when_the_load_falls_and_enough_tokens_are_left():
    # Forwards cost the same up to 8 rows, then grow in proportion; drafts are cheap and mostly accepted.
    controller = _controller(3, lambda rows: max(0.02, 0.0025 * rows), lambda n: 0.0001, {"seen": 3})
    busy = [f"busy{i}" for i in range(16)]
    assert controller.choose(busy, [3] * 16, base_rows=16) == [0] * 16
    crowd = [Running(r, 100, 400) for r in busy]
    assert controller.to_wake(crowd) == []  # at 16 requests drafting does not pay
    # Forwards now cost the same up to 64 rows: drafting pays at 9 requests, but the load has not
    # halved since they went dormant (admission's word alone is the optimistic one).
    flat = controller.target_seconds
    controller.target_seconds = ForwardCost()
    for rows in (1, 8, 64):
        controller.target_seconds.observe(rows, 1, 0.02)
    assert controller.speculation_pays(9) and controller.to_wake(crowd[:9]) == []
    controller.target_seconds = flat
    # The load falls to 2. Their two 100-token contexts cost 0.5 s to recompute (as 200 decode rows);
    # drafting saves about 0.015 s a token at this load: 300 tokens left pay for it, 30 do not.
    assert controller.to_wake([Running("busy0", 100, 130), Running("busy1", 100, 130)]) == []
    left = [Running("busy0", 100, 400), Running("busy1", 100, 400)]
    assert controller.to_wake(left) == left
    assert not any(map(controller.is_dormant, ("busy0", "busy1")))
    assert controller.to_wake(left) == []  # woken once: nothing to wake
    # Recomputed, they come back as new requests and draft without the admission's question.
    assert all(controller.choose(["busy0", "busy1"], [3, 3], base_rows=2))
    assert not controller.is_dormant("busy0")


def test_a_step_s_parts_are_timed_into_their_curves():
    controller = GoodputController(2)
    prefill = StepLayout.build(["a", "b"], [0, 0], [5, 5], [0, 0], torch.device("cpu"))
    decode = StepLayout.build(["a", "b"], [5, 6], [3, 3], [2, 2], torch.device("cpu"))
    # The draft curve learns only once the same requests had drafts two steps running (not from the
    # step after a prefill, which was offered drafts and ran none: its drafter catches up on the prompt).
    for step, layout in enumerate([prefill, decode, decode]):
        controller.choose(["a", "b"], [2, 2], base_rows=2)
        controller.step_began()
        time.sleep(0.002)
        controller.lap("other")
        time.sleep(0.004)
        controller.lap("draft")
        time.sleep(0.02)
        controller.lap("target")
        time.sleep(0.003)
        controller.lap("keep")
        controller.step_ended(layout)
        assert (2 in controller.draft_seconds.points) == (step == 2)
    # The target curve prices decode rows: the prompts' step is not one of its points.
    assert list(controller.target_seconds.points) == [(6, 2)]
    assert controller.target_seconds.points[6, 2] >= 0.02
    assert 0.002 <= controller.other_seconds.points[2] < controller.target_seconds.points[6, 2]
    assert 0.002 <= controller.draft_seconds.points[2] < controller.target_seconds.points[6, 2]  # per forward of a chain of 2
    assert 0.003 <= controller.keep_seconds.points[2] < controller.target_seconds.points[6, 2]  # by requests not dormant


def _timed_step(controller: GoodputController, layout: StepLayout, **laps: float) -> None:
    """End a step whose parts took ``laps`` seconds (the rest: the few microseconds spent here)."""
    controller.step_began()
    controller._laps.update(laps)
    controller.step_ended(layout)


def test_a_catch_up_is_a_one_off_cost_spread_over_a_request_s_life():
    # Forwards cost the same at any size; drafts are cheap and accepted.
    controller = _controller(3, lambda rows: 0.01, lambda n: 0.001, {"seen": 3})
    cpu = torch.device("cpu")
    _timed_step(controller, StepLayout.build(["a"], [0], [5], [0], cpu), target=0.01, keep=0.0005)  # its prompt
    # The first drafting step: the chain's 3 forwards and a 50 ms catch-up over the prompt.
    _timed_step(controller, StepLayout.build(["a"], [5], [4], [3], cpu), draft=0.053, target=0.01, keep=0.0005)
    assert controller.keep_seconds(1) == pytest.approx(0.0005)  # keeping draft state is not the catch-up ...
    assert controller.catch_up_seconds == pytest.approx(0.05)  # ... which each request owes once
    for _ in range(10):
        controller.observe_verified("a", 3, 3)
    controller.forget("a", num_output_tokens=40)
    assert controller.life_tokens == 40  # what a request emits in its life
    assert controller.speculation_pays(1)  # spread over 40 tokens, the catch-up costs little
    for i in range(60):  # requests of 4 tokens: the catch-up is most of what drafting costs them
        controller.forget(f"short{i}", num_output_tokens=4)
    assert controller.life_tokens < 5 and not controller.speculation_pays(1)


def test_a_dormant_request_s_prompt_is_not_priced_as_decode_rows():
    controller = _controller(3, lambda rows: 0.001 * rows, lambda n: 0.01 * n, {r: 0 for r in range(4)})
    assert controller.admit(["d"]) == {"d"}  # drafts do not pay: it starts dormant
    cpu, before = torch.device("cpu"), dict(controller.target_seconds.points)
    _timed_step(controller, StepLayout.build(["d"], [0], [200], [0], cpu), target=0.05)  # its prompt
    assert controller.target_seconds.points == before
    _timed_step(controller, StepLayout.build(["d"], [200], [1], [0], cpu), target=0.002)  # its decode steps are
    assert controller.target_seconds.points[1, 1] > before[1, 1]


def test_keeping_a_prompt_s_states_is_a_one_off_cost_not_the_keep_curve_s():
    controller = _controller(3, lambda rows: 0.01, lambda n: 0.001, {"seen": 3})
    cpu = torch.device("cpu")
    _timed_step(controller, StepLayout.build(["a", "b"], [9, 9], [1, 1], [0, 0], cpu), keep=0.001)  # 2 decoding
    # "c"'s prompt runs in two chunks beside them, each step fusing its 8 rows as well: 20 ms more.
    for start in (0, 8):
        layout = StepLayout.build(["a", "b", "c"], [10 + start // 8] * 2 + [start], [1, 1, 8], [0, 0, 0], cpu)
        _timed_step(controller, layout, keep=0.001 + 0.02)
    assert list(controller.keep_seconds.points) == [2]  # a decoding request's keep is not a prompt's share
    assert controller.prompt_keep_seconds == 0.0  # owed by "c", known once it finishes
    before = controller._keeping(1, [0.9, 0.8, 0.7])
    controller.forget("c", num_output_tokens=40)
    share = 0.021 - controller.keep_seconds(3)
    assert controller.prompt_keep_seconds == pytest.approx(2 * share)  # both chunks, once per request
    assert controller._keeping(1, [0.9, 0.8, 0.7]) > before  # spread over a request's life, like the catch-up


def test_while_few_drafts_back_the_rates_one_request_admitted_dormant_drafts_to_learn_them():
    # Forwards cost the same up to 8 rows; a draft forward 3 ms: drafting pays at high acceptance only.
    controller = _controller(3, lambda rows: max(0.01, 0.00125 * rows), lambda n: 0.003, {})
    for _ in range(3):  # a first request's drafts, all refused: the rates fall to about a third
        controller.observe_verified("first", 3, 0)
    assert not controller.speculation_pays(2)
    assert controller.choose(["probe", "other"], [3, 3], base_rows=2) == [3, 0]  # one probe, all its drafts
    assert not controller.is_dormant("probe") and controller.is_dormant("other")
    assert controller.best_counts(["probe"], [3], base_rows=1) != [3]  # the model alone would give it fewer
    for _ in range(MIN_EVIDENCE):  # what the probe learns: drafts are accepted
        controller.observe_verified("probe", 3, 3)
    assert controller.best_counts(["probe"], [3], base_rows=1) == [3]  # now the model's choice too
    assert controller.speculation_pays(1)
    # Rates backed by enough drafts are trusted: where they say drafts do not pay, nobody probes.
    sure = _controller(3, lambda rows: max(0.01, 0.00125 * rows), lambda n: 0.003, {"poor": 0})
    assert sure.choose(["new"], [3], base_rows=1) == [0] and sure.is_dormant("new")
    # So are a draft's recorded rates: they weigh as many drafts, and where they say drafts do not pay
    # one request, the first request starts dormant rather than drafting to learn them.
    recorded = GoodputController(3, recorded=(0.3, 0.1, 0.03))
    for rows in (1, 2, 4, 8):
        recorded.target_seconds.observe(rows, 1, max(0.01, 0.00125 * rows))
    for _ in range(MIN_TIMED_DRAFT_STEPS):
        recorded.draft_seconds.observe(1, 0.003)
    assert recorded.acceptance.evidence() >= MIN_EVIDENCE and not recorded.speculation_pays(1)
    assert recorded.choose(["first"], [3], base_rows=1) == [0] and recorded.is_dormant("first")


def test_while_few_timed_steps_back_a_draft_forward_s_price_one_request_admitted_dormant_drafts_to_learn_it():
    # Well-accepted drafts (a recorded 0.8 / 0.7 / 0.6), but a warm-up's first draft forwards priced dear:
    # at 8 ms a forward drafting does not pay, at the 1 ms they take in steady serving it does.
    def warmed_up(dear_steps: int) -> GoodputController:
        controller = GoodputController(3, recorded=(0.8, 0.7, 0.6))
        for rows in range(1, 5):
            controller.target_seconds.observe(rows, 1, 0.01)
        for _ in range(dear_steps):
            controller.draft_seconds.observe(1, 0.008)
        return controller

    controller = warmed_up(3)
    assert not controller.speculation_pays(1)
    assert controller.choose(["probe", "other"], [3, 3], base_rows=2) == [3, 0]  # one probe, all its drafts
    assert not controller.is_dormant("probe") and controller.is_dormant("other")
    for _ in range(MIN_TIMED_DRAFT_STEPS - 3):  # what the probe's steps measure
        controller.draft_seconds.observe(1, 0.001)
    assert controller.speculation_pays(1)  # learnt: drafting pays, and later requests start drafting
    assert controller.choose(["probe", "next"], [3, 3], base_rows=2) == [3, 3]
    assert not controller.is_dormant("next")
    # Where the probe's steps confirm the price, it drafts for PROBE_STEPS steps (its first drafts are
    # accepted less than its later ones: cut short, it would teach the rates that stretch alone) and
    # until they are timed steps enough, then as the model says.
    confirmed = warmed_up(3)
    for step in range(PROBE_STEPS):
        assert confirmed.choose(["probe"], [3], base_rows=1) == [3], step
        confirmed.draft_seconds.observe(1, 0.008)
    assert confirmed.choose(["probe"], [3], base_rows=1) == [0]
    slow = warmed_up(3)  # a probe whose steps are not timed (each catches up after a prompt chunk, say)
    for step in range(PROBE_STEPS + 1):
        assert slow.choose(["probe"], [3], base_rows=1) == [3], step
    # A price backed by enough timed steps is trusted: where it says drafting does not pay, nobody probes.
    sure = warmed_up(MIN_TIMED_DRAFT_STEPS)
    assert sure.choose(["new"], [3], base_rows=1) == [0] and sure.is_dormant("new")


def test_a_request_left_without_drafts_goes_dormant_until_it_is_forgotten():
    controller = _controller(3, lambda rows: 0.01 + 0.001 * rows, lambda n: 0.0005 * n, {"r": 0, "s": 3})
    for _ in range(DORMANT_WINDOW - 1):
        assert controller.choose(["r", "s"], [3, 3], base_rows=2)[0] == 0
    assert not controller.is_dormant("r")
    controller.choose(["r", "s"], [3, 3], base_rows=2)
    assert controller.is_dormant("r") and not controller.is_dormant("s")
    for _ in range(40):  # even where drafting it would pay now, it is not offered drafts again
        controller.observe_verified("s", 3, 3)
    assert controller.choose(["r"], [3], base_rows=1) == [0]
    controller.forget("r")  # finished: the id starts afresh
    assert not controller.is_dormant("r")


def test_every_few_steps_a_drafting_request_gets_one_draft_more():
    """A forward's cost at a size is learnt only from steps that run it, so a size priced dear once would
    never run again: every PROBE_EVERY-th choice gives a request that drafts one draft more (never one
    to a request the model left without), and a cheaper reading there moves the choice."""
    controller = GoodputController(5)
    for rows in range(1, 9):  # 7 rows and more priced dear, as after a passing slowdown
        controller.target_seconds.observe(rows, 1, 0.01 if rows <= 6 else 0.05)
    controller.draft_seconds.observe(1, 0.0001)
    for _ in range(40):
        controller.observe_verified("sure", 5, 5)
        controller.observe_verified("never", 5, 0)
    chosen = [controller.choose(["sure", "never"], [5, 5], base_rows=2) for _ in range(2 * PROBE_EVERY)]
    probes = [step for step, counts in enumerate(chosen, start=1) if counts != [4, 0]]
    assert probes == [PROBE_EVERY, 2 * PROBE_EVERY]
    assert all(chosen[step - 1] == [5, 0] for step in probes)
    for _ in range(20):  # what the probes measure: 7 rows cost what 6 do
        controller.target_seconds.observe(7, 1, 0.01)
    assert controller.best_counts(["sure", "never"], [5, 5], base_rows=2) == [5, 0]


class Scripted(GoodputController):
    """Drafts for ``"r"`` when the script says so (and for every other request always), then applies
    the controller's own dormancy rule."""

    def __init__(self, script):
        super().__init__(3)
        self.script = iter(script)

    def best_counts(self, requests, caps, base_rows, probe=False):
        drafted = next(self.script)
        return [cap if drafted or request != "r" else 0 for request, cap in zip(requests, caps)]


@pytest.mark.parametrize("drafting", [DORMANT_MAX_DRAFTING, DORMANT_MAX_DRAFTING + 1])
def test_a_request_drafting_now_and_then_goes_dormant_too(drafting):
    """Drafting in few of the last steps costs nearly what drafting every step does (each resumption
    catches up on every token missed): at most DORMANT_MAX_DRAFTING of DORMANT_WINDOW steps is dormant."""
    script = [True] * drafting + [False] * (DORMANT_WINDOW - drafting)
    controller = Scripted(script)
    for _ in script:
        controller.choose(["r", "other"], [3, 3], base_rows=2)
    assert controller.is_dormant("r") == (drafting <= DORMANT_MAX_DRAFTING)
    assert not controller.is_dormant("other")


def test_requests_start_drafting_at_the_admission_margin_and_go_on_while_drafting_pays():
    """What the model leaves out falls on drafting's side at admission (ADMIT_GAIN); requests already
    drafting go on while their step promises STEP_GAIN times the rate of none; and a step that gives
    nobody drafts says drafting does not pay at this load, so its requests stop keeping draft state at
    once instead of for DORMANT_WINDOW steps."""
    assert STEP_GAIN < ADMIT_GAIN
    requests = list(range(4))
    controller = _controller(3, lambda rows: 0.01 + 0.001 * rows, lambda n: 0.002, {r: 1 for r in requests})
    assert controller.choose(requests, [3] * 4, base_rows=4) == [1] * 4  # admitted drafting: drafts are cheap

    def promise(draft_seconds: float) -> float:
        """Draft forwards now cost ``draft_seconds`` (timed steps enough to be trusted): the step's best
        rate over the rate of none."""
        controller.draft_seconds = CostCurve()
        for _ in range(MIN_TIMED_DRAFT_STEPS):
            controller.draft_seconds.observe(4, draft_seconds)
        prior = controller.acceptance.engine_rates()
        counts, rate = controller._best(4, [_chain(controller.acceptance.rates(r, prior)) for r in requests])
        return rate * (controller.other_seconds(4) + controller.target_seconds(4, 4)) / 4 if any(counts) else 1.0

    assert STEP_GAIN < promise(0.009) < ADMIT_GAIN  # dearer drafts: one each promises 1.04x
    assert controller.choose(requests, [3] * 4, base_rows=4) == [1] * 4  # drafting, they go on
    assert controller.admit([*requests[1:], "new"]) == {"new"}  # a newcomer starts dormant
    assert promise(0.011) == 1.0  # dearer still: no draft pays
    assert controller.choose(requests, [3] * 4, base_rows=4) == [0] * 4
    assert all(map(controller.is_dormant, requests))
    # Left without drafts for its own poor acceptance, where drafting pays at the engine-wide rates, a
    # request waits out the window (its acceptance might be a bad start).
    sure = _controller(3, lambda rows: 0.01 + 0.001 * rows, lambda n: 0.002, {r: 3 for r in requests})
    sure.choose(["poor"], [3], base_rows=1)
    for _ in range(40):
        sure.observe_verified("poor", 3, 0)
    assert sure.choose(["poor"], [3], base_rows=1) == [0] and sure.speculation_pays(1)
    assert not sure.is_dormant("poor")
