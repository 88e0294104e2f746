"""The acceptance alarm: one warning line when speculation silently stops paying.

A draft trained for another target, wrong aux layer ids, a wrong ``d2t`` or EAGLE3 / 3.1 flags that
differ from training all load, run and lose every draft without an error. The engine's alarm watches
position-0 acceptance (the share of drafts whose first token was accepted) and says so, once:

- *The draft*: when the position-0 rate is far below what the draft should reach: under a quarter of
  the rate its checkpoint records (``training.json``, :class:`~specdec.proposers.draft_record.DraftRecord`),
  or under 5% when it records none. It fires only once the counts make that certain: the chance that a
  draft really accepting at that floor would show so few acceptances is under 1e-4 (an exact binomial
  tail). A draft accepting nothing is reported after :attr:`AcceptanceAlarm.collapse_horizon` drafts
  (38 for a recorded 0.87, 180 without a record).
- *One request*: when a request's rate is far below (under a quarter of) the other requests' rate,
  with the same kind of certainty (1e-3) once the others have made 64 drafts: a sign of a proposer
  state bug (that request's draft state not rolled back or restored right), or of text the draft cannot
  follow (one token repeated, say). Every request is tested, but on the zoo's pairs no request on
  ordinary text comes near the floor (the lowest seen: 0.35 of the others' rate), and the chance of
  crossing it falls off steeply with the distance. A request accepting nothing is reported after
  about 50 drafts.

Each warning is logged on the ``specdec`` logger and returned to the engine, which adds it to
``spec_stats().warnings``. Acceptance under sampling is lower than the greedy rate a checkpoint
records, but on the zoo's pairs not by a factor of four: the floors leave room for it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Hashable, Sequence

import attrs

from specdec.proposers.draft_record import DraftRecord

log = logging.getLogger("specdec")

FAR_BELOW = 0.25  # "far below" a rate: under this share of it
NEAR_ZERO = 0.05  # the floor of a draft whose checkpoint records no acceptance
MIN_DRAFTS = 16  # no verdict on fewer drafts, however few were accepted
DRAFT_SIGNIFICANCE = 1e-4
REQUEST_SIGNIFICANCE = 1e-3
MIN_OTHER_DRAFTS = 64  # drafts of the other requests before one request is compared with them

_CAUSES = {
    "eagle3": "a draft trained for another target (or another version of it), wrong aux layer ids "
              "(eagle_config.eagle_aux_hidden_state_layer_ids, capture-before), a wrong or missing d2t map, "
              "EAGLE3 vs EAGLE3.1 flags (fc_norm, norm_output) that differ from how it was trained",
    "draft_model": "a draft trained for another target or on other text, or a tokenizer that numbers tokens "
                   "differently",
}


@attrs.frozen
class DraftExpectation:
    """What the alarm compares with: the speculative ``method``, the ``draft`` (its folder), the greedy
    acceptance per position its checkpoint records (None: unrecorded) and the warnings its loading raised."""

    method: str
    draft: str
    recorded: tuple[float, ...] | None = None
    load_warnings: tuple[str, ...] = ()

    @classmethod
    def for_draft(cls, method: str, folder: str | Path, load_warnings: Sequence[str] = ()) -> "DraftExpectation":
        record = DraftRecord.read(folder)
        return cls(method, str(folder), record.acceptance if record else None, tuple(load_warnings))

    @property
    def floor(self) -> float:
        """The position-0 rate the draft should at least reach."""
        return self.recorded[0] * FAR_BELOW if self.recorded else NEAR_ZERO


class AcceptanceAlarm:
    """Position-0 counts, engine-wide and per request, and the two alarms over them (module docstring)."""

    def __init__(self, expectation: DraftExpectation):
        self.expectation = expectation
        self.drafts = self.accepted = 0  # engine-wide, since the engine was built
        self._requests: dict[Hashable, list[int]] = {}  # request -> [drafts, accepted at position 0]
        self._warned_requests: set[Hashable] = set()
        self.draft_warned = False

    @property
    def collapse_horizon(self) -> int:
        """Drafts after which a draft accepting none of them is reported."""
        n = MIN_DRAFTS
        while binomial_cdf(0, n, self.expectation.floor) >= DRAFT_SIGNIFICANCE:
            n += 1
        return n

    def observe(self, requests: Sequence[Hashable], num_drafts: Sequence[int],
                num_accepted: Sequence[int]) -> list[str]:
        """Count one step (per request: drafts made, drafts accepted); returns the warnings it raised (logged)."""
        found = []
        for request, drafted, accepted in zip(requests, num_drafts, num_accepted):
            if drafted:
                counts = self._requests.setdefault(request, [0, 0])
                counts[0] += 1
                counts[1] += accepted > 0
                self.drafts += 1
                self.accepted += accepted > 0
        if not self.draft_warned and self._below(self.accepted, self.drafts, self.expectation.floor,
                                                 DRAFT_SIGNIFICANCE):
            self.draft_warned = True
            found.append(self._draft_message())
        for request, drafted in zip(requests, num_drafts):
            if drafted and request not in self._warned_requests:
                message = self._check_request(request)
                if message is not None:
                    self._warned_requests.add(request)
                    found.append(message)
        for message in found:
            log.warning(message)
        return found

    def forget(self, request: Hashable) -> None:
        """Drop a finished request's counts."""
        self._requests.pop(request, None)
        self._warned_requests.discard(request)

    @staticmethod
    def _below(accepted: int, drafts: int, floor: float, significance: float) -> bool:
        """Whether ``accepted`` of ``drafts`` is certainly (beyond ``significance``) below ``floor``."""
        return (drafts >= MIN_DRAFTS and accepted < floor * drafts
                and binomial_cdf(accepted, drafts, floor) < significance)

    def _check_request(self, request: Hashable) -> str | None:
        drafts, accepted = self._requests[request]
        others, others_accepted = self.drafts - drafts, self.accepted - accepted
        if others < MIN_OTHER_DRAFTS:
            return None
        rate = others_accepted / others
        if not self._below(accepted, drafts, rate * FAR_BELOW, REQUEST_SIGNIFICANCE):
            return None
        e = self.expectation
        return (f"{e.method} draft {e.draft!r}: request {request} had {accepted} of its {drafts} drafts accepted at "
                f"position 0 ({accepted / drafts:.3f}) while the other requests' rate is {rate:.3f} ({others} drafts): "
                "a sign of a proposer state bug (this request's draft state not rolled back or restored right, "
                "e.g. after a rejection or a preemption), or of text the draft cannot follow (one token repeated, say)")

    def _draft_message(self) -> str:
        e = self.expectation
        should = (f"its checkpoint records {e.recorded[0]:.3f}" if e.recorded
                  else "a working draft accepts far more")
        family = "eagle3" if e.method.startswith("eagle3") else e.method
        causes = _CAUSES.get(family, "a draft trained for another target")
        seen = "; see the warnings at load" if e.load_warnings else ""
        return (f"speculative decoding is not paying off: {e.method} draft {e.draft!r} had {self.accepted} of "
                f"{self.drafts} drafts accepted at position 0 ({self.accepted / self.drafts:.3f}) where {should}. "
                f"Likely causes: {causes}{seen}")


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (no underflow at large n)."""
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_p, log_q, log_n = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    terms = [log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q for i in range(k + 1)]
    top = max(terms)
    return math.exp(top) * math.fsum(math.exp(t - top) for t in terms)
