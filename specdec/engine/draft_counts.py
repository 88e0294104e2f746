"""How many drafts each request gets per step: the interface the engine steps through, and its answer
with ``adaptive`` off (every request its cap). :class:`specdec.engine.goodput.GoodputController` is the
answer with it on."""

from __future__ import annotations

from typing import Hashable, Sequence

from specdec.runtime.layout import StepLayout


class FixedDrafts:
    """``adaptive`` off: every request that may draft gets its cap. Nothing is timed or learned (a
    timed step would synchronise an asynchronous device)."""

    def choose(self, requests: Sequence[Hashable], caps: Sequence[int], base_rows: int) -> list[int]:
        return list(caps)

    def step_began(self) -> None:
        pass

    def lap(self, part: str) -> None:
        pass

    def step_ended(self, layout: StepLayout) -> None:
        pass

    def observe_verified(self, request: Hashable, num_drafts: int, num_accepted: int) -> None:
        pass

    def admit(self, requests: Sequence[Hashable]) -> frozenset:
        """The dormant ones among a step's ``requests`` (deciding for new ones whether they start so)."""
        return frozenset()

    def is_dormant(self, request: Hashable) -> bool:
        """Whether ``request`` gets no drafts unless it is woken (its draft state need not be kept)."""
        return False

    def to_wake(self, seqs: Sequence) -> list:
        """The dormant requests among the step's unfinished ``seqs`` to recompute so that they draft again."""
        return []

    def forget(self, request: Hashable, num_output_tokens: int = 0) -> None:
        pass

    def cost_state(self) -> None:
        return None

    def load_cost_state(self, state) -> None:
        pass
