"""Shared attrs validators for the project's configuration classes.

Every config (``SamplingParams``, ``EngineArgs``, ``SchedulerConfig``, proposer options, the benchmark's
workload) checks its fields with these, so a wrong value fails at construction with one line:
``"<label> must be an int >= 1, got 0"``. The label is the field's name, unless the class defines a
classmethod ``_field_label(name) -> str`` (``"SamplingParams.top_k"``, ``"concurrency (--concurrency)"``).

``bool`` is an ``int`` subclass in Python; ``max_tokens=True`` is a mistake, not the number 1, so the int
checks refuse bools.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import attrs

Validator = Callable[[Any, "attrs.Attribute", Any], None]


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def field_label(instance: Any, name: str) -> str:
    """How errors name field ``name`` of ``instance`` (see the module docstring)."""
    label = getattr(type(instance), "_field_label", None)
    return label(name) if label is not None else name


def satisfies(test: Callable[[Any], bool], wants: str, optional: bool = False) -> Validator:
    """Values for which ``test`` holds; errors say the value must be ``wants`` ("an int >= 1")."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        if not test(value):
            label = field_label(instance, attribute.name)
            raise ValueError(f"{label} must be {wants}{' or None' if optional else ''}, got {value!r}")

    return validate


def int_at_least(lowest: int, *, optional: bool = False, meaning: str = "") -> Validator:
    """An int >= ``lowest``; ``meaning`` is added in parentheses (``"0 = off"``)."""
    note = f" ({meaning})" if meaning else ""
    return satisfies(lambda v: is_int(v) and v >= lowest, f"an int >= {lowest}{note}", optional)


def int_in_range(lowest: int, highest: int, *, optional: bool = False, what: str = "an int") -> Validator:
    """An int in ``[lowest, highest)``."""
    return satisfies(lambda v: is_int(v) and lowest <= v < highest, what, optional)


def number_at_least(lowest: float, *, optional: bool = False, meaning: str = "") -> Validator:
    """A finite number >= ``lowest``."""
    note = f" ({meaning})" if meaning else ""
    return satisfies(lambda v: is_real(v) and v >= lowest, f"a finite number >= {lowest:g}{note}", optional)


def number_in(lowest: float, highest: float, *, meaning: str = "") -> Validator:
    """A finite number in ``(lowest, highest]``."""
    note = f" ({meaning})" if meaning else ""
    return satisfies(lambda v: is_real(v) and lowest < v <= highest, f"a number in ({lowest:g}, {highest:g}]{note}", False)


def boolean(*, optional: bool = False) -> Validator:
    """True or False (the string form's ``true`` / ``false``)."""
    return satisfies(lambda v: isinstance(v, bool), "true or false", optional)


def non_empty_str(*, optional: bool = False) -> Validator:
    return satisfies(lambda v: isinstance(v, str) and bool(v), "a non-empty string", optional)


def one_of(choices: Iterable[str], *, optional: bool = False) -> Validator:
    allowed = tuple(choices)
    return satisfies(lambda v: v in allowed, f"one of {', '.join(map(repr, allowed))}", optional)


def int_list(lowest: int = 0) -> Validator:
    """A list of ints >= ``lowest``."""
    return satisfies(lambda v: isinstance(v, list) and all(is_int(x) and x >= lowest for x in v),
                  f"a list of ints >= {lowest}", False)
