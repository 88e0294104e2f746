"""How many drafts each request gets this step: the speculative config's ``adaptive`` key.

Speculation pays when the tokens it adds outweigh what the drafts cost. A draft at position j of a
request emits a token with the probability that drafts 1..j are all accepted; it costs a verify row
in the target's forward and a share of the draft chain. Both costs depend on the load: on a CPU (and
on a GPU past its memory-bound batch sizes) a forward's time grows with its rows, so at high
concurrency the rows of a long, rarely accepted draft are better spent elsewhere or not at all.

Each step :class:`GoodputController` chooses, for every request that may draft (the scheduler's cap,
``num_speculative_tokens`` at most), a count in 0..cap that maximises the step's expected emitted
tokens per second:

- expected tokens: ``1 + sum_j prod_{m <= j} a_m`` for a request given j drafts, with ``a_m`` its
  estimated acceptance at position m given the drafts before it were accepted
  (:class:`AcceptanceEstimates`: its own recent counts, shrunk towards the engine-wide rates, which
  start from the acceptance the draft's checkpoint records);
- seconds: the target forward over the step's decode and verify rows, by its rows and its requests
  (:class:`ForwardCost`: a forward's rows from a few requests cost less than as many from many; a
  prompt's cost the same whatever is chosen), plus the draft chain (its depth times the seconds of
  one draft forward over the drafting requests), plus the rest of the step (scheduling, sampling,
  bookkeeping: by requests, whatever their drafts), read off costs measured by every step
  (:class:`CostCurve`); the target's and the draft's shapes at sizes not run yet come from forwards
  of growing size timed when the engine starts (:mod:`specdec.engine.calibration`), at the level the
  steps measure, and keeping draft state takes the draft's shape.

The search takes drafts one at a time, the likeliest to be accepted first, and keeps the count at
which the rate peaked (a request's drafts are always a prefix of its chain), if it beats
:data:`STEP_GAIN` times the rate of none. Zero drafts for everyone is a valid answer. It is lossless
by construction: only how many drafts are verified changes, never how they are verified.

A request given drafts in at most :data:`DORMANT_MAX_DRAFTING` of its last :data:`DORMANT_WINDOW`
steps, or left without in a step that gives nobody drafts at a load where none would start drafting,
goes *dormant*: it gets no drafts unless woken, and the engine tells the proposer
(``StepFeedback.dormant``) so that it stops keeping the request's draft state. Keeping an EAGLE3 head
ready costs every step whether it drafts or not (the target captures its aux layers, the proposer keeps
their fused states), and each resumption costs a catch-up over every token missed, so drafting now
and then costs nearly what drafting every step does; a load at which drafts do not pay would
otherwise make an adaptive engine slower than one that never speculates.

Finding that out takes a request :data:`DORMANT_WINDOW` steps of kept state, a large part of a short
request's life, so a request starts dormant when a step of the present requests would give no drafts
even to those accepted at the engine-wide rates, once the cost of keeping their draft state is counted
and the dormant ones among them draft nothing (:meth:`GoodputController.speculation_pays`); while
those rates rest on too few drafts, or a draft forward's price on too few timed steps, one such
request at a time drafts instead, to learn them. The
question is asked afresh for every request admitted, so speculation comes back when the load falls
and the dormant requests have finished. A dormant request still running then is *woken* once, when
drafting its remaining tokens saves more than rebuilding its draft state costs: the engine has the
scheduler recompute it from prompt + output, as a preemption does (:meth:`GoodputController.to_wake`).

Under tensor parallelism every rank must choose alike: the acceptance estimates follow the tokens,
which every rank shares, and the cost curves are the driver's (sent with each step's message).
"""

from __future__ import annotations

import heapq
import itertools
import operator
import time
from typing import Hashable, Sequence

import torch

from specdec.engine.acceptance_estimates import INITIAL_ACCEPTANCE, AcceptanceEstimates
from specdec.engine.cost_curve import CostCurve, ForwardCost, MeasuredPoints
from specdec.engine.draft_counts import FixedDrafts
from specdec.runtime.layout import StepLayout

# A request given drafts in at most this many of its last DORMANT_WINDOW steps gets none again (dormant).
DORMANT_WINDOW = 16
DORMANT_MAX_DRAFTING = 4
# Requests start drafting only where that promises this many times the rate of none (what the model leaves
# out falls on drafting's side: at 1.05, concurrency 32 on the zoo MiniMax-M3 pair started a few requests
# drafting beside many dormant ones and served 0.93x of none), and a step of requests already drafting
# drafts where it promises STEP_GAIN times: a margin there too would make the step's choice a coin flip
# wherever drafting pays by about the margin, and a step that gives nobody drafts sends its requests
# dormant for good (there the model promised 1.11x, a fixed k=2 served 1.09x, and a margin of 1.1 in the
# step's choice left 2 of 3 rounds dormant).
ADMIT_GAIN = 1.1
STEP_GAIN = 1.0
# While fewer drafts than this back the engine-wide acceptance (a recorded one counts RECORD_WEIGHT), a
# request admitted where drafting does not pay drafts anyway, one at a time (:meth:`GoodputController.admit`).
MIN_EVIDENCE = 32
# ... and while fewer timed steps than this back the price of a draft forward.
MIN_TIMED_DRAFT_STEPS = 16
# Such a probe drafts every draft for at least this many steps, however soon the evidence suffices.
PROBE_STEPS = 32
# Every PROBE_EVERY-th choice gives a request that drafts one draft more than the best rate's
# (:meth:`GoodputController.choose`).
PROBE_EVERY = 8
# A dormant request is woken (recomputed, to draft again) when drafting its remaining tokens would save
# this many times what the recompute costs (its remaining tokens are a bound: a stop may come sooner).
WAKE_GAIN = 2.0
# ... and the step has at most 1 / WAKE_LOAD_FALL of the requests it had when the request went dormant.
WAKE_LOAD_FALL = 2


class GoodputController(FixedDrafts):
    """Chooses each request's draft count per step (see the module docstring).

    The engine marks a step's parts as they end (:meth:`step_began`, then :meth:`lap` with
    ``"draft"``, ``"target"``, ``"keep"`` or ``"other"``, then :meth:`step_ended`): the draft chain,
    the target's forward, the proposer keeping its draft state (``on_step``), and everything else
    (scheduling, sampling, verification, bookkeeping: a cost per step that grows with its requests,
    not with their drafts, and that speculation spreads over more tokens)."""

    def __init__(self, num_speculative_tokens: int, prior: float = INITIAL_ACCEPTANCE,
                 recorded: Sequence[float] | None = None,
                 device: torch.device = torch.device("cpu")):
        self.k = num_speculative_tokens
        self.device = device
        self.target_seconds = ForwardCost()  # one target forward, by rows and requests
        self.draft_seconds = CostCurve()  # one draft forward (a chain's step), by drafting requests
        self.other_seconds = CostCurve()  # the rest of a step, by requests
        # keeping draft states ready, by requests not dormant; shaped like the draft chain's step
        self.keep_seconds = CostCurve(borrowed_shape=True)
        # A drafter's catch-up when a request starts (or resumes) drafting: seconds per request, and the
        # tokens a request emits in its life (over those finished) that it is spread over; moving averages.
        self.catch_up_seconds = 0.0
        self.life_tokens = 0.0
        # Keeping a request's prompt states (fusing its prompt rows), owed once too: seconds per request
        # (a moving average over finished requests of what their prompt steps took beyond the keep curve).
        self.prompt_keep_seconds = 0.0
        self._prompt_keep: dict[Hashable, float] = {}  # per request whose prompt ran: its share so far
        self.acceptance = AcceptanceEstimates(num_speculative_tokens, prior, recorded)
        self._history: dict[Hashable, int] = {}  # per request: bit i set = drafted i steps ago, top bit = seen
        self._dormant: set[Hashable] = set()
        self._dormant_load: dict[Hashable, int] = {}  # per dormant request: the step's requests then
        self._woken: set[Hashable] = set()  # requests woken once (:meth:`to_wake`), to be admitted drafting
        self._probing: dict[Hashable, int] = {}  # admitted to draft every draft (:meth:`admit`): its steps so far
        self._drafted: frozenset = frozenset()  # the requests whose drafts the last step verified
        self._choices = 0  # steps chosen for, which sets the probing ones (the same count on every rank)
        self._laps: dict[str, float] = {}
        self._last = 0.0

    # ----- the decision -----
    def choose(self, requests: Sequence[Hashable], caps: Sequence[int], base_rows: int) -> list[int]:
        """Draft counts (``0 <= count <= cap``) for ``requests`` in a step whose decoding requests run
        ``base_rows`` rows before drafts: the best rate's (:meth:`best_counts`), none for dormant requests.
        Prompt rows in the step are left out: they cost the same whatever is chosen (priced, the choice
        would depend on whether a prompt happens to run beside).

        Every :data:`PROBE_EVERY`-th step gives one draft more than the best rate's to a request that drafts: a
        forward's cost at a size is learnt only from steps that run it, so a size priced dear once (a
        passing slowdown) would never run, and be measured, again (at concurrency 1 on the zoo MiniMax-M3
        pair with a cap of 5, 6 rows read 14-18 ms where they take 9.4, and 5 drafts were never chosen)."""
        self._start(requests)
        caps = [0 if request in self._dormant else cap for request, cap in zip(requests, caps)]
        if not any(caps):
            return caps  # nothing to choose (every request dormant, at a load where drafts do not pay)
        self._choices += 1
        counts = self.best_counts(requests, caps, base_rows, probe=self._choices % PROBE_EVERY == 0)
        if self._probing:  # a probe drafts every draft (:meth:`admit`)
            for i, (request, cap) in enumerate(zip(requests, caps)):
                if request in self._probing and cap:
                    counts[i] = cap
                    self._probing[request] += 1
                    if self._probing[request] >= PROBE_STEPS and not self._lacks_evidence():
                        del self._probing[request]  # enough learnt: it drafts as the model says
        num_dormant = sum(map(self._dormant.__contains__, requests))
        self._note_drafting(requests, caps, counts,
                            at_once=not any(counts) and not self.speculation_pays(len(requests), num_dormant))
        return counts

    def admit(self, requests: Sequence[Hashable]) -> frozenset:
        """The dormant ones among a step's ``requests``, once those new to the controller have been given
        their start: dormant when drafting does not pay for the step's requests (:meth:`speculation_pays`;
        a woken request always drafts). The scheduler asks as it admits them, so that a request starting
        dormant matches the prefix cache on the target's pools alone (it needs no draft state).

        While fewer than :data:`MIN_EVIDENCE` verified drafts back the engine-wide acceptance, one request
        at a time that would start dormant drafts every draft instead (a probe): dormant requests verify no
        drafts, so the rates would stay what the first few drafts made them: after a warm-up of one
        8-token request on the zoo llama-tiny pair (3 drafting steps, all refused) a guessed prior's
        first-position rate read 0.34 (0.77 once learnt), and every later request started dormant. A
        recorded acceptance backs the rates as a probe would (a few refusals leave it above 0.7): a draft
        with a record is not probed, for a probe drafts its whole cap where drafting does not pay.

        So does a draft forward priced from fewer than :data:`MIN_TIMED_DRAFT_STEPS` timed steps: an
        engine's first forwards pay one-off costs (oneDNN primitives made for each new shape, caches and
        allocator cold, the attention layout timed once), and a price nobody drafts at is never measured
        again. On the zoo llama-tiny pair (batch 1, 16 stdlib prompts) the warm-up's three draft steps
        priced a draft forward at 1.8-3.1 ms and 4 verify rows at 4.4-6.1 ms, where they take 0.9 and
        2.8 in steady serving: every request started dormant, at 0.98-1.06x of plain decoding where a
        fixed k=3 ran 1.19-1.24x.

        A probe drafts every draft for :data:`PROBE_STEPS` steps at least: a request's first drafts are
        accepted less than its later ones (there, at the first position, 0.52 in the first four drafting
        steps of the 16 requests and 0.70-0.84 in the next 28), so a probe cut short as soon as the
        evidence sufficed (after 8 steps there) would teach the rates mostly its hardest stretch."""
        self._start(requests)
        return frozenset(filter(self._dormant.__contains__, requests))

    def _lacks_evidence(self) -> bool:
        """Whether the engine-wide rates or a draft forward's price rest on too little to trust (:meth:`admit`)."""
        return (self.acceptance.evidence() < MIN_EVIDENCE
                or self.draft_seconds.num_observed < MIN_TIMED_DRAFT_STEPS)

    def _start(self, requests: Sequence[Hashable]) -> None:
        """Give the requests new to the controller their start (:meth:`admit`)."""
        new = [request for request in requests if request not in self._history]
        if new:
            dormant = not self.speculation_pays(len(requests), sum(map(self._dormant.__contains__, requests)))
            for request in new:
                self._history[request] = 1  # the marker bit (:meth:`_note_drafting`)
                if not dormant or request in self._woken:
                    continue
                if not self._probing and self._lacks_evidence():
                    self._probing[request] = 0
                else:
                    self._dormant.add(request)
                    self._dormant_load[request] = len(requests)

    def best_counts(self, requests: Sequence[Hashable], caps: Sequence[int], base_rows: int, *,
                    probe: bool = False) -> list[int]:
        """The counts at which the step's expected tokens per second peak, if :data:`STEP_GAIN` times the
        rate of none (the module docstring); with ``probe``, one draft more for a request given drafts,
        where its cap allows."""
        prior = self.acceptance.engine_rates()
        return self._best(base_rows, [_chain(self.acceptance.rates(r, prior)[:cap]) for r, cap in zip(requests, caps)],
                          margin=STEP_GAIN, probe=probe)[0]

    def speculation_pays(self, num_requests: int, num_dormant: int = 0) -> bool:
        """Whether a decode step of ``num_requests`` requests, ``num_dormant`` of them dormant and the
        others accepted at the engine-wide rates and allowed every draft, would give any of them drafts.

        The dormant requests are counted as the step's choice counts them: their rows and their share
        of the step cost what they cost, and they draft nothing. A request admitted beside many of them
        would draft with few others, paying the chain's depth for a small part of the step; asked as if
        every request could draft, admission would start it drafting, the step's choice would give it
        no drafts, and it would keep its draft state for nothing until it went dormant.

        Drafting then costs more than its forwards: every step, whether a request drafts or not, the
        proposer keeps its draft state (fusing the target's states), and each request's draft catches up
        on its prompt once (:meth:`_keeping`), which a dormant request does not. And it must promise
        :data:`ADMIT_GAIN` times the rate of no drafts at all: what the model leaves out (steps whose
        requests draft unevenly, a load priced from curves extrapolated past what has run) all falls on
        the side of drafting."""
        chain, awake = _chain(self.acceptance.engine_rates()), num_requests - num_dormant
        return any(self._best(num_requests, [chain] * awake + [[]] * num_dormant, keeping=self._keeping(awake, chain),
                              margin=ADMIT_GAIN)[0])

    def _keeping(self, awake: int, chain: list[float]) -> float:
        """Seconds a step of ``awake`` requests drafting along ``chain`` owes for their draft state: keeping
        it, and each request's one-off costs (its catch-up when it starts drafting, keeping its prompt's
        states), spread over the tokens of its life (a request emits ``1 + sum(chain)`` of them a step):
        as a cost per step, the catch-up priced keeping 3-15x what steps took (zoo MiniMax-M3, c16 and c32)."""
        spread = (1.0 + sum(chain)) / self.life_tokens if self.life_tokens else 0.0
        return self.keep_seconds(awake) + awake * (self.catch_up_seconds + self.prompt_keep_seconds) * spread

    def to_wake(self, seqs: Sequence) -> list:
        """The dormant requests among the step's unfinished ``seqs`` (anything with ``seq_id``,
        ``num_tokens``, ``max_len`` and ``is_finished``) to recompute, as a preemption does, so that they
        draft again; each is woken once.

        A dormant request keeps no draft state, so drafting again means running its context through the
        target once more (its aux layers captured). That pays when the load has fallen, to at most
        1 / :data:`WAKE_LOAD_FALL` of the requests beside it when it went dormant, and to where drafting
        pays for every request present (:meth:`speculation_pays`, the ones woken before counted dormant),
        and drafting their remaining tokens saves :data:`WAKE_GAIN` times the recompute (the woken
        requests' contexts priced as decode rows, dearer than a prompt's). Without it, a request left
        alone at the end of a busy spell decodes plainly to its end where drafting is fastest. The fall
        is asked for because admission's word alone woke requests at c32 on the zoo MiniMax-M3 pair."""
        seqs = [s for s in seqs if not s.is_finished]
        dormant = [s for s in seqs if s.seq_id in self._dormant and s.seq_id not in self._woken
                   and len(seqs) * WAKE_LOAD_FALL <= self._dormant_load.get(s.seq_id, 0)]
        n, stay = len(seqs), sum(s.seq_id in self._dormant for s in seqs) - len(dormant)
        if not dormant or not self.speculation_pays(n, stay):
            return []
        # One request's seconds per token, plainly and with the step's best drafts at the engine-wide rates.
        chain = _chain(self.acceptance.engine_rates())
        _, rate = self._best(n, [chain] * (n - stay) + [[]] * stay, keeping=self._keeping(n - stay, chain))
        saved = self.other_seconds(n) + self.target_seconds(n, n) - n / rate
        remaining = sum(s.max_len - s.num_tokens for s in dormant) / len(dormant)
        if saved * remaining < WAKE_GAIN * self.target_seconds(sum(s.num_tokens for s in dormant), len(dormant)):
            return []
        for s in dormant:  # admitted again as new (:meth:`choose`), drafting
            self._dormant.discard(s.seq_id)
            self._dormant_load.pop(s.seq_id, None)
            self._history.pop(s.seq_id, None)
            self._woken.add(s.seq_id)
        return dormant

    def _best(self, base_rows: int, gains: list[list[float]], keeping: float = 0.0, margin: float = 1.0,
              probe: bool = False) -> tuple[list[int], float]:
        """Best counts for requests whose drafts 1, 2, ... are accepted with probabilities ``gains[i]``,
        and the step's expected tokens per second at them (before a probe; with none chosen, ``margin``
        times the rate of none); ``keeping``: seconds a step owes only if it drafts at all; drafts only at
        ``margin`` times the rate of none; ``probe``: one draft more for a request the best gives drafts
        (:meth:`choose`)."""
        # Seconds of the step: the rest of it (whatever the drafts) + the target's forward over its rows
        # (by drafts taken) + the chain's depth times a draft forward over the drafting requests.
        other = self.other_seconds(len(gains))
        target = self.target_seconds.over(base_rows, base_rows + sum(map(len, gains)), base_rows)
        draft = self.draft_seconds.over(0, len(gains))

        # Every request in the step emits a token whatever its drafts; each draft adds its gain. A
        # request's gains fall along its chain, so taking drafts in falling order of gain keeps every
        # request's drafts a prefix: the best step is the best of these prefixes.
        counts = [0] * len(gains)
        value, depth, drafting = float(len(gains)), 0, 0
        best_rate, best_taken = margin * value / max(other + target[0], 1e-12), 0
        taken = []  # request indices, in the order their drafts were taken
        heap = [(-g[0], i) for i, g in enumerate(gains) if g]
        heapq.heapify(heap)
        while heap:
            gain, i = heapq.heappop(heap)
            drafting += counts[i] == 0
            counts[i] += 1
            value, depth = value - gain, max(depth, counts[i])
            taken.append(i)
            rate = value / max(other + keeping + target[len(taken)] + depth * draft[drafting], 1e-12)
            if rate > best_rate:
                best_rate, best_taken = rate, len(taken)
            if counts[i] < len(gains[i]):
                heapq.heappush(heap, (-gains[i][counts[i]], i))
        counts = [0] * len(gains)
        for i in taken[:best_taken]:
            counts[i] += 1
        if probe:  # the next draft of a request that drafts: who drafts stays the model's choice
            deeper = next((i for i in taken[best_taken:] if counts[i]), None)
            if deeper is not None:
                counts[deeper] += 1
        return counts, best_rate

    def _note_drafting(self, requests: Sequence[Hashable], caps: Sequence[int], counts: Sequence[int], *,
                       at_once: bool) -> None:
        """Record who drafted this step; requests that drafted in few of their last steps go dormant, and
        ``at_once`` (nobody drafts, and admission would start nobody drafting: not at this load) every
        request that could have; one left without for its own poor acceptance waits out the window."""
        full = 1 << DORMANT_WINDOW  # the marker bit, shifted past the window once it has been filled
        for request, cap, count in zip(requests, caps, counts):
            if not cap:
                continue  # a step it could not draft in (a prompt chunk, its last tokens) says nothing
            history = (self._history.get(request, 1) << 1) | bool(count)
            if history >= full:  # the marker reached the window's end: its last steps are all known
                history = full | (history & (full - 1))
            if at_once or history >= full and (history & (full - 1)).bit_count() <= DORMANT_MAX_DRAFTING:
                self._dormant.add(request)
                self._dormant_load[request] = len(requests)
            self._history[request] = history

    # ----- what a step taught -----
    def step_began(self) -> None:
        self._laps = {"draft": 0.0, "target": 0.0, "keep": 0.0, "other": 0.0}
        self._last = clock(self.device)

    def lap(self, part: str) -> None:
        """The time since the last mark was spent on ``part``."""
        now = clock(self.device)
        self._laps[part] += now - self._last
        self._last = now

    def step_ended(self, layout: StepLayout) -> None:
        """The step that began ran ``layout`` (its rows, and the drafts each request really had).

        A drafter that skipped steps first catches up on the tokens it missed (an EAGLE3 head runs over
        them; over the whole prompt after a request's prefill), which costs more than the chain's depth
        in forwards; that cost is owed whenever drafting resumes, not chosen now, so the draft curve
        learns only from steps whose drafting requests all had drafts verified in the step before (drafts
        offered are not enough: a prefill step is offered drafts and runs none). What the chain's forwards
        do not explain in the other steps is the catch-up of the requests that had no drafts in the step
        before: each request's share is its catch-up (:meth:`_keeping` spreads it over a request's life).

        The target curve prices decode rows, so it learns only from steps that run no prompt rows: a
        prompt's rows cost less each than a verify row's (one long causal run against many short ones),
        and a step of two prompts would otherwise read as a cheap large step, pulling the curve's
        non-decreasing fit down at every smaller size. So does the keep curve: keeping draft state fuses
        the target's states of every row, a prompt's too, and a step with prompts would price keeping a
        decoding request at a prompt's share (after concurrency 1 on the zoo MiniMax-M3 pair, 4.7 ms for
        16 requests where their decode steps take 1.4). What the curve does not explain in such a step is
        the prompting requests' one-off share (:meth:`_keeping`), summed over their prompt chunks."""
        self.lap("other")
        laps = self._laps
        # A dormant request's prompt keeps nothing, but its rows are no decode rows either.
        with_prompts = [r for r, rows, drafts in zip(layout.requests, layout.query_lens, layout.num_drafts)
                        if rows != 1 + drafts]
        prompting = [r for r in with_prompts if r not in self._dormant]
        if not with_prompts:
            self.target_seconds.observe(layout.num_rows, layout.num_requests, laps["target"])
        self.other_seconds.observe(layout.num_requests, laps["other"])
        drafted = frozenset(r for r, n in zip(layout.requests, layout.num_drafts) if n)
        if drafted and drafted <= self._drafted:
            self.draft_seconds.observe(len(drafted), laps["draft"] / max(layout.num_drafts))
        elif drafted and self.draft_seconds.points:
            residual = max(0.0, laps["draft"] - max(layout.num_drafts) * self.draft_seconds(len(drafted)))
            self.catch_up_seconds = _average(self.catch_up_seconds, residual / len(drafted - self._drafted), 0.25)
        self._drafted = drafted
        awake = sum(request not in self._dormant for request in layout.requests)
        if awake and not prompting:
            self.keep_seconds.observe(awake, laps["keep"])
        elif prompting and self.keep_seconds.points:
            share = max(0.0, laps["keep"] - self.keep_seconds(awake)) / len(prompting)
            for request in prompting:
                self._prompt_keep[request] = self._prompt_keep.get(request, 0.0) + share

    def observe_verified(self, request: Hashable, num_drafts: int, num_accepted: int) -> None:
        self.acceptance.observe(request, num_drafts, num_accepted)

    def is_dormant(self, request: Hashable) -> bool:
        return request in self._dormant

    def forget(self, request: Hashable, num_output_tokens: int = 0) -> None:
        """``request`` finished, having emitted ``num_output_tokens`` (its life, for :meth:`_keeping`)."""
        if num_output_tokens:
            self.life_tokens = _average(self.life_tokens, num_output_tokens, 0.1)
        if request in self._prompt_keep:
            self.prompt_keep_seconds = _average(self.prompt_keep_seconds, self._prompt_keep.pop(request), 0.25)
        self.acceptance.forget(request)
        self._history.pop(request, None)
        self._dormant.discard(request)
        self._dormant_load.pop(request, None)
        self._woken.discard(request)
        self._probing.pop(request, None)

    # ----- lockstep under tensor parallelism -----
    def cost_state(self) -> tuple:
        """The cost curves and the one-off costs per request (what differs between ranks: each times its own steps)."""
        return (*(curve.state() for curve in self._curves()), self.catch_up_seconds, self.prompt_keep_seconds)

    def load_cost_state(self, state: tuple) -> None:
        """Adopt the driver's costs (:meth:`cost_state`)."""
        *curves, self.catch_up_seconds, self.prompt_keep_seconds = state
        for curve, points in zip(self._curves(), curves):
            curve.load(points)

    def _curves(self) -> tuple[MeasuredPoints, ...]:
        return self.target_seconds, self.draft_seconds, self.other_seconds, self.keep_seconds


def _average(old: float, new: float, weight: float) -> float:
    """A moving average's next value (its first observation taken whole)."""
    return new if not old else old + weight * (new - old)


def _chain(rates: Sequence[float]) -> list[float]:
    """The probability that drafts 1..j are all accepted, for each j, from conditional rates."""
    return list(itertools.accumulate(rates, operator.mul))


def clock(device: torch.device) -> float:
    """Now, in seconds, after the device's queued work (timings of asynchronous devices need it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
