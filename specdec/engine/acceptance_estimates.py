"""Per request and draft position, how likely a draft is accepted: what the adaptive controller
(:mod:`specdec.engine.goodput`) weighs a draft's gain with."""

from __future__ import annotations

from typing import Hashable, Sequence

# Weight (in observations) of the prior in an estimate: the engine-wide rate in a request's, the
# position before's (the first position's: INITIAL_ACCEPTANCE) in the engine-wide rates.
PRIOR_WEIGHT = 4.0
# Before any draft is verified: the conditional acceptance assumed at every position ...
INITIAL_ACCEPTANCE = 0.6
# ... unless the draft's checkpoint records its acceptance on held-out text, which weighs this many
# observations in the engine-wide rates: a few unlucky drafts (one hard prompt's first tokens) cannot
# make a draft look useless.
RECORD_WEIGHT = 32.0
# Per observation, older counts fade by this factor (requests change topic; loads change).
REQUEST_DECAY = 0.95
ENGINE_DECAY = 0.995


class AcceptanceEstimates:
    """Per request and position, the probability that draft j is accepted when drafts 1..j-1 were.

    Counts fade with each observation (:data:`REQUEST_DECAY`, :data:`ENGINE_DECAY`); a request's
    estimate is its counts plus :data:`PRIOR_WEIGHT` observations at the engine-wide rate. The
    engine-wide rate at the first position is its counts plus as many observations at
    :data:`INITIAL_ACCEPTANCE` (``prior``); at a later position, plus as many at the rate of the
    position before. With the rates a draft's checkpoint records (``recorded``: the share of drafts
    accepted at each position), each position's prior is its recorded conditional rate, weighing
    :data:`RECORD_WEIGHT` observations. A position is offered only when the controller expects its draft to pay, so a
    constant prior there would decide for good: at 0.6 the zoo MiniMax-M3 draft's fourth and fifth
    drafts (accepted at 0.8 when the third was) were too rarely offered to be learned, and an adaptive
    cap of 5 drafted like a fixed k of 3 or 4."""

    def __init__(self, k: int, prior: float = INITIAL_ACCEPTANCE, recorded: Sequence[float] | None = None):
        self.k = k
        self.prior = conditional_rates(recorded) if recorded else (prior,)
        self.prior_weight = RECORD_WEIGHT if recorded else PRIOR_WEIGHT
        self._recorded_weight = RECORD_WEIGHT if recorded else 0.0  # a record is evidence; a guess is not
        self._offered = [0.0] * k  # engine-wide
        self._accepted = [0.0] * k
        self._requests: dict[Hashable, tuple[list[float], list[float]]] = {}

    def engine_rates(self) -> list[float]:
        rates, rate, weight = [], self.prior[0], self.prior_weight
        for j, (accepted, offered) in enumerate(zip(self._accepted, self._offered)):
            prior = self.prior[j] if j < len(self.prior) else rate  # past the prior's positions: the one before's
            rate = (accepted + weight * prior) / (offered + weight)
            rates.append(rate)
        return rates

    def evidence(self) -> float:
        """Verified drafts behind the engine-wide rate at the first position: those this engine verified
        (faded as its counts are) and, with a recorded prior, the record's weight (drafts its checkpoint
        verified on held-out text). The guessed prior is no evidence."""
        return self._offered[0] + self._recorded_weight

    def rates(self, request: Hashable, prior: list[float] | None = None) -> list[float]:
        """``request``'s estimates; ``prior``: :meth:`engine_rates`, when the caller has them already."""
        prior = prior if prior is not None else self.engine_rates()
        counts = self._requests.get(request)
        if counts is None:
            return prior
        offered, accepted = counts
        return [(a + PRIOR_WEIGHT * p) / (o + PRIOR_WEIGHT) for a, o, p in zip(accepted, offered, prior)]

    def observe(self, request: Hashable, num_drafts: int, num_accepted: int) -> None:
        """``num_accepted`` of ``num_drafts`` drafts were accepted: positions 1..accepted were, the next
        (if any) was offered and refused, the rest were never reached."""
        if not num_drafts:
            return
        offered, accepted = self._requests.setdefault(request, ([0.0] * self.k, [0.0] * self.k))
        reached = min(num_accepted + 1, num_drafts)
        for counts, decay in (((offered, accepted), REQUEST_DECAY), ((self._offered, self._accepted), ENGINE_DECAY)):
            for j in range(self.k):
                counts[0][j] *= decay
                counts[1][j] *= decay
            for j in range(reached):
                counts[0][j] += 1.0
            for j in range(num_accepted):
                counts[1][j] += 1.0

    def forget(self, request: Hashable) -> None:
        self._requests.pop(request, None)


def conditional_rates(shares: Sequence[float]) -> tuple[float, ...]:
    """Per position, the acceptance given the drafts before were accepted, from the share of drafts
    accepted at each position (vLLM's per-position rate, what a draft's checkpoint records)."""
    rates, before = [], 1.0
    for share in shares:
        rates.append(min(1.0, share / before) if before > 0 else 0.0)
        before = share
    return tuple(rates)
