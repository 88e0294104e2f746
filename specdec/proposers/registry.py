"""Speculative method name -> proposer factory: the one table every config form is checked against.

A factory (usually the proposer class) is called with the config's keys as keyword arguments,
``num_speculative_tokens`` included, and returns a :class:`~specdec.proposers.base.Proposer`; heavy
work (loading a draft checkpoint, registering pools) belongs in the proposer's ``setup``. A method's
keys are its factory's options class (``specdec.proposers.options``). Methods come from the built-ins
below, :func:`register_proposer` in the running process, or an installed distribution's entry point in
group ``specdec.proposers`` (``myspec = "pkg.module:MyProposer"``).
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from specdec.proposers.base import Proposer
from specdec.proposers.options import factory_kwargs, options_class_of
from specdec.registry import Registry

ENTRY_POINT_GROUP = "specdec.proposers"

_BUILTINS = {
    "ngram": "specdec.proposers.ngram:NgramProposer",
    "draft_model": "specdec.proposers.draft_model:DraftModelProposer",
    "eagle3": "specdec.proposers.eagle3.proposer:Eagle3Proposer",
    "eagle3.1-mla": "specdec.proposers.eagle3.proposer:Eagle3MLAProposer",
    "eagle3-unshifted": "specdec.proposers.eagle3.unshifted:UnshiftedEagle3Proposer",
}
# The methods this package ships (the registry may hold more).
BUILTIN_METHODS: tuple[str, ...] = tuple(_BUILTINS)

PROPOSERS: Registry[Callable[..., Proposer]] = Registry(
    "speculative method", ENTRY_POINT_GROUP, _BUILTINS, missing="unknown method {name}; valid methods: {choices}"
)

_OPTIONS: dict[tuple[str, int], type] = {}  # (method, id(factory)) -> options class, read once


def register_proposer(method: str, factory: str | Callable[..., Proposer]) -> None:
    """Make ``method`` selectable in every config form; ``factory`` is a callable or ``"module:attr"``.

    The factory's keyword parameters (or its ``options_class``) are the method's keys.
    """
    PROPOSERS.register(method, factory)


def available_proposers() -> list[str]:
    """Every selectable method: built-in, registered and installed."""
    return PROPOSERS.names()


def method_options(method: str) -> type:
    """The attrs options class of ``method`` (raises ``ValueError`` listing the methods if unknown)."""
    factory = PROPOSERS.get(method)
    key = (method, id(factory))
    if key not in _OPTIONS:
        _OPTIONS[key] = options_class_of(factory, method)
    return _OPTIONS[key]


def unknown_method_message(method: Any) -> str:
    return PROPOSERS.unknown_message(method)


def create_proposer(config) -> Proposer:
    """The proposer for a parsed :class:`~specdec.proposers.config.SpeculativeConfig`."""
    factory = PROPOSERS.get(config.method)
    proposer = factory(**factory_kwargs(factory, config.options))
    k = config.options.num_speculative_tokens
    if getattr(proposer, "num_speculative_tokens", None) != k:
        raise ValueError(
            f"speculative method {config.method!r}: its proposer has num_speculative_tokens="
            f"{getattr(proposer, 'num_speculative_tokens', None)!r} but the config asks for {k}; "
            "the factory must take num_speculative_tokens and keep it"
        )
    return proposer


def options_dict(options: Any) -> dict[str, Any]:
    """The keys that are set (not None), in declaration order."""
    return {k: v for k, v in attrs.asdict(options, recurse=False).items() if v is not None}
