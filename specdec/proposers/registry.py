"""Speculative method name -> proposer factory.

A factory takes the parsed :class:`~specdec.proposers.config.SpeculativeConfig` and returns a
:class:`~specdec.proposers.base.Proposer`; heavy work (loading a draft checkpoint, registering
pools) belongs in the proposer's ``setup``, which the engine calls with the target and the cache.
Factories are named ``"module:attr"`` and imported on first use, so a method's dependencies load
only when it is chosen. Methods the config accepts but nobody registered yet fail with a clear
error when selected.
"""

from __future__ import annotations

import importlib
from typing import Callable, Union

from specdec.proposers.base import Proposer

Factory = Callable[..., Proposer]

_PROPOSERS: dict[str, Union[str, Factory]] = {
    "ngram": "specdec.proposers.ngram_proposer:NgramProposer.from_config",
    "draft_model": "specdec.proposers.draft_model:DraftModelProposer.from_config",
    "eagle3": "specdec.proposers.eagle3.proposer:Eagle3Proposer.from_config",
    "eagle3.1-mla": "specdec.proposers.eagle3.proposer:Eagle3Proposer.from_config",
    "eagle3-unshifted": "specdec.proposers.eagle3.unshifted:UnshiftedEagle3Proposer.from_config",
}


def register_proposer(method: str, factory: str | Factory) -> None:
    """Make ``method`` selectable; ``factory`` is a callable ``(config) -> Proposer`` or ``"module:attr"``."""
    _PROPOSERS[method] = factory


def available_proposers() -> list[str]:
    return sorted(_PROPOSERS)


def _resolve(target: str | Factory) -> Factory:
    if callable(target):
        return target
    module_name, attr = target.split(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]


def create_proposer(config) -> Proposer:
    """The proposer for a parsed speculative config."""
    method = config.method
    if method not in _PROPOSERS:
        raise ValueError(
            f"speculative method {method!r} has no proposer registered in this build; "
            f"available: {available_proposers()}"
        )
    return _resolve(_PROPOSERS[method])(config)
