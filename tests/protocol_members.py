"""Conformance to one of the library's protocols: the check behind the protocol tests.

``isinstance`` with a ``runtime_checkable`` protocol says only that every member exists. These
helpers also hold each member to its declaration: a declared method must be callable, and a data
attribute must hold a value of its annotated type (``required_block_size: int | None`` rejects a
string). Members come from the protocol and every protocol it extends.
"""

from __future__ import annotations

import inspect
import types
import typing


def protocol_members(protocol: type) -> dict[str, object]:
    """Name -> declaration (the annotated type of a data attribute, else the function or property)."""
    members: dict[str, object] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (typing.Protocol, typing.Generic, object) or not getattr(cls, "_is_protocol", False):
            continue
        members.update({name: value for name, value in vars(cls).items() if not name.startswith("_")})
    members.update({name: hint for name, hint in typing.get_type_hints(protocol).items() if not name.startswith("_")})
    return members


def conformance_problems(obj: object, protocol: type) -> list[str]:
    """What keeps ``obj`` from implementing ``protocol``, one line per member (empty when it does)."""
    problems = []
    for name, declared in sorted(protocol_members(protocol).items()):
        if not hasattr(obj, name):
            problems.append(f"{name} is missing")
            continue
        value = getattr(obj, name)
        if inspect.isfunction(declared):
            if not callable(value):
                problems.append(f"{name} is {value!r}, not a method")
        elif not isinstance(declared, property) and not isinstance(value, _runtime_types(declared)):
            problems.append(f"{name} is {value!r}, not {declared}")
    return problems


def without(obj: object, protocol: type, member: str) -> types.SimpleNamespace:
    """A stand-in with every member of ``protocol`` that ``obj`` has, except ``member``."""
    return types.SimpleNamespace(
        **{name: getattr(obj, name) for name in protocol_members(protocol) if name != member}
    )


def _runtime_types(hint) -> tuple[type, ...]:
    # ``int | None`` -> (int, NoneType); ``Mapping[str, tuple]`` -> (Mapping,); ``object`` -> (object,).
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in _runtime_types(arg))
    return (typing.get_origin(hint) or hint,)
