"""Speculative-decoding counters with vLLM's definitions (shared/reference/FACTS.md section 1).

- ``num_drafts``: (request, step) pairs that had at least one draft token; a request with 0
  drafts in a step is not a draft.
- ``num_draft_tokens`` / ``num_accepted_tokens``: drafted and accepted tokens over all steps.
- ``accepted_per_position[i]``: drafts whose token at position i was accepted.
- acceptance at position i = ``accepted_per_position[i] / num_drafts``; mean acceptance length
  (tau) = ``1 + num_accepted_tokens / num_drafts``; draft acceptance rate = accepted / drafted.
  With no drafts yet the rates are 0.0 and tau is 1.0 (each step emits its one target token).
- ``num_drafts_histogram[j]``: (request, step) pairs that could draft and were given j drafts
  (j = 0..k): k each without ``adaptive``, the controller's choices with it (a proposer may still
  return fewer, which ``num_draft_tokens`` counts).
- ``num_drafts_by_verifier``: drafts (as in ``num_drafts``) by the name of the verifier that checked
  them: ``greedy`` (all-greedy steps), ``coupled`` (deterministic drafts in a sampling step: the output
  is plain sampling's, token for token), ``rejection`` (drafts with a distribution: the output follows
  the target's law), or a verifier passed in by name. Its values add up to ``num_drafts``.
- ``warnings``: one line each, what the engine found wrong with speculation: a draft that does not fit
  its target at load, acceptance far below what the draft should reach, one request's acceptance
  collapsing while the others' does not (:mod:`specdec.engine.acceptance_alarm`). Not counters:
  ``reset`` keeps them.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import attrs
import numpy as np
import torch

Counts = Union[Sequence[int], np.ndarray, torch.Tensor]


def _non_negative(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"SpecStats.{attr.name} must be an int >= 0, got {value!r}")


def _non_negative_list(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, list):
        raise ValueError(f"SpecStats.{attr.name} must be a list of ints, got {type(value).__name__}")
    for v in value:
        _non_negative(_inst, attr, v)


def _named_counts(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
        raise ValueError(f"SpecStats.{attr.name} must be a dict of name -> int, got {value!r}")
    for v in value.values():
        _non_negative(_inst, attr, v)


def _as_counts(name: str, values: Counts) -> list[int]:
    """The per-request counts as Python ints (a step has few requests: plain Python is cheaper than numpy)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
            raise ValueError(f"{name} must be a 1-D sequence of ints (one per request), got {values.dtype} {values.shape}")
        return values.tolist()
    counts = list(values)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in counts):
        raise ValueError(f"{name} must be a 1-D sequence of ints (one per request), got {counts!r}")
    return [int(v) for v in counts]


@attrs.define
class SpecStats:
    """Counters since construction or ``reset()``; ``observe`` adds one engine step."""

    num_drafts: int = attrs.field(default=0, validator=_non_negative)
    num_draft_tokens: int = attrs.field(default=0, validator=_non_negative)
    num_accepted_tokens: int = attrs.field(default=0, validator=_non_negative)
    accepted_per_position: list[int] = attrs.field(factory=list, validator=_non_negative_list)
    num_drafts_histogram: list[int] = attrs.field(factory=list, validator=_non_negative_list)
    num_drafts_by_verifier: dict[str, int] = attrs.field(factory=dict, validator=_named_counts)
    warnings: list[str] = attrs.field(factory=list)

    @classmethod
    def for_k(cls, num_speculative_tokens: int) -> "SpecStats":
        """Empty counters with ``accepted_per_position`` pre-sized to k and the histogram to k + 1 (they grow if needed)."""
        return cls(accepted_per_position=[0] * num_speculative_tokens,
                   num_drafts_histogram=[0] * (num_speculative_tokens + 1))

    def count_chosen(self, chosen: Sequence[int], caps: Sequence[int]) -> None:
        """Add one step's draft counts: ``chosen[i]`` drafts for each request whose cap ``caps[i]`` allowed any."""
        for count, cap in zip(chosen, caps):
            if cap:
                _grow(self.num_drafts_histogram, count + 1)
                self.num_drafts_histogram[count] += 1

    def count_verified(self, verifier: str, num_drafts: int) -> None:
        """Add ``num_drafts`` drafts (requests with drafts in one step) checked by the verifier called ``verifier``."""
        if num_drafts:
            self.num_drafts_by_verifier[verifier] = self.num_drafts_by_verifier.get(verifier, 0) + num_drafts

    def observe(self, num_drafts_per_request: Counts, num_accepted_per_request: Counts) -> None:
        """Add one step: per request, how many draft tokens it had and how many were accepted."""
        drafted = _as_counts("num_drafts_per_request", num_drafts_per_request)
        accepted = _as_counts("num_accepted_per_request", num_accepted_per_request)
        if len(drafted) != len(accepted):
            raise ValueError(
                f"num_drafts_per_request and num_accepted_per_request differ in length "
                f"({len(drafted)} vs {len(accepted)}); pass one entry per request to both"
            )
        if any(not 0 <= a <= d for d, a in zip(drafted, accepted)):
            raise ValueError("each request needs 0 <= num_accepted <= num_drafts")
        self.num_drafts += sum(d > 0 for d in drafted)
        self.num_draft_tokens += sum(drafted)
        self.num_accepted_tokens += sum(accepted)
        _grow(self.accepted_per_position, max(drafted, default=0))
        # A request with a accepted drafts counts at positions 0..a-1.
        for a in accepted:
            for i in range(a):
                self.accepted_per_position[i] += 1

    def add(self, other: "SpecStats") -> None:
        """Add another set of counters (another request's, say) to these."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.num_drafts_histogram, other.num_drafts_histogram)):
            _grow(mine, len(theirs))
            for i, count in enumerate(theirs):
                mine[i] += count
        for verifier, count in other.num_drafts_by_verifier.items():
            self.count_verified(verifier, count)
        self.warnings.extend(w for w in other.warnings if w not in self.warnings)

    def reset(self) -> None:
        """Zero every counter (the lists keep their lengths; ``warnings`` stay)."""
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * len(self.accepted_per_position)
        self.num_drafts_histogram = [0] * len(self.num_drafts_histogram)
        self.num_drafts_by_verifier = {}

    @property
    def acceptance_per_position(self) -> list[float]:
        if self.num_drafts == 0:
            return [0.0] * len(self.accepted_per_position)
        return [count / self.num_drafts for count in self.accepted_per_position]

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Every counter and derived rate, JSON-serialisable (the CLI's ``spec_stats``)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_per_position": self.acceptance_per_position,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "num_drafts_histogram": list(self.num_drafts_histogram),
            "num_drafts_by_verifier": dict(self.num_drafts_by_verifier),
            "warnings": list(self.warnings),
        }


def _grow(counts: list[int], length: int) -> None:
    """Pad ``counts`` with zeros to ``length`` entries."""
    counts.extend([0] * (length - len(counts)))
