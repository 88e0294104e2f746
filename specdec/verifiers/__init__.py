"""Verifiers, selected by name: ``greedy``, ``coupled`` (sampling that reproduces plain sampling token
for token, for deterministic drafts) and ``rejection`` (lossless in law, for drafts sampled from q)."""

from __future__ import annotations

from typing import Callable

from specdec.verifiers.base import PAD_TOKEN_ID, Verifier, VerifyResult
from specdec.verifiers.coupled import CoupledVerifier
from specdec.verifiers.greedy import GreedyVerifier
from specdec.verifiers.rejection import RejectionSampler

_VERIFIERS: dict[str, Callable[[], Verifier]] = {
    "greedy": GreedyVerifier,
    "coupled": CoupledVerifier,
    "rejection": RejectionSampler,
}


def register_verifier(name: str, factory: Callable[[], Verifier]) -> None:
    """Make a verifier selectable by ``name``."""
    _VERIFIERS[name] = factory


def available_verifiers() -> list[str]:
    return sorted(_VERIFIERS)


def get_verifier(name: str) -> Verifier:
    """Instantiate the verifier called ``name``; unknown names list the valid choices."""
    if not (isinstance(name, str) and name in _VERIFIERS):
        raise ValueError(f"unknown verifier {name!r}; choose one of {available_verifiers()}")
    return _VERIFIERS[name]()


__all__ = [
    "PAD_TOKEN_ID",
    "CoupledVerifier",
    "GreedyVerifier",
    "RejectionSampler",
    "Verifier",
    "VerifyResult",
    "available_verifiers",
    "get_verifier",
    "register_verifier",
]
