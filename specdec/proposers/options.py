"""A speculative method's keys: one attrs class per method, declared or read off its factory.

Every method's keys are the fields of an attrs *options class*, validated at construction with the
shared validators (``specdec.validation``). A factory declares its class in an ``options_class``
attribute (the built-ins do: their keys need bounds and defaults that depend on each other), or its
keys are read off its keyword parameters (:func:`options_from_signature`): a parameter's annotation
(``int``, ``float``, ``bool``, ``str``, optionally ``| None``) or, unannotated, its default's type gives
the key's type; a parameter without a default is a required key. ``num_speculative_tokens`` is
required by every method; the common keys (:class:`CommonOptions`) keep their validation wherever
they appear.
"""

from __future__ import annotations

import functools
import inspect
import os
import types
import typing
from typing import Any, Callable

import attrs

from specdec.models.quantization import SCHEMES as QUANTIZATION_SCHEMES
from specdec.validation import boolean, int_at_least, is_int, is_real, non_empty_str, one_of, satisfies

# Types a key may have: the string form parses values as these.
KEY_KINDS = (int, float, bool, str)
# What a key of each kind must be, in error messages of the string form.
_KIND_WORDS = {int: "an int", float: "a number", bool: "true or false", str: "a string"}


def option(kind: type, validator, default: Any = None, converter=None, doc: str = ""):
    """An options-class field of ``kind`` (one of ``KEY_KINDS``); ``default=attrs.NOTHING`` makes it required."""
    return attrs.field(default=default, validator=validator, converter=converter, metadata={"kind": kind, "doc": doc})


def _model_path(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


class _Labelled:
    """Error messages name a key as ``speculative config: KEY``."""

    @classmethod
    def _field_label(cls, name: str) -> str:
        return f"speculative config: {name}"


@attrs.frozen(kw_only=True)
class CommonOptions(_Labelled):
    """Keys every built-in method takes.

    - ``num_speculative_tokens``: k, drafts per request per step (>= 1, required).
    - ``attention_backend``: the draft's attention backend (default: the target's).
    - ``block_size``: the draft pool's page size (default: what its backend prefers).
    - ``adaptive``: the engine chooses each request's drafts per step, ``num_speculative_tokens`` at
      most, for the most tokens per second (:mod:`specdec.engine.goodput`); every method takes it,
      since the engine, not the proposer, reads it.
    """

    num_speculative_tokens: int = option(int, int_at_least(1), default=attrs.NOTHING)
    attention_backend: str | None = option(str, non_empty_str(optional=True))
    block_size: int | None = option(int, int_at_least(1, optional=True))
    adaptive: bool = option(bool, boolean(), default=False)


# Keys the engine reads: every method takes them, a plug-in's factory included (it never sees them).
ENGINE_KEYS = ("adaptive",)


# How a model-based proposer drafts for a sampling request (vLLM's ``draft_sample_method``).
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
DEFAULT_DRAFT_SAMPLE_METHOD = "probabilistic"


@attrs.frozen(kw_only=True)
class ModelOptions(CommonOptions):
    """The common keys plus ``model``, the draft checkpoint folder (required), and
    ``draft_sample_method``: for a sampling request, ``"greedy"`` drafts the draft's argmax with no
    distribution (deterministic drafts: the engine's coupled verifier makes the output plain
    sampling's, token for token), ``"probabilistic"`` draws each draft from q and reports q (rejection
    sampling: the output follows the target's law). Greedy requests always draft the argmax.
    ``quantization``: the draft's linear layers weight-only quantized when it loads, ``"int8"`` or
    ``"int4"`` (:mod:`specdec.models.quantization`): cheaper draft steps on a CPU, other drafts, the
    same output."""

    model: str = option(str, non_empty_str(), default=attrs.NOTHING, converter=_model_path)
    draft_sample_method: str = option(str, one_of(DRAFT_SAMPLE_METHODS), default=DEFAULT_DRAFT_SAMPLE_METHOD)
    quantization: str | None = option(str, one_of(QUANTIZATION_SCHEMES, optional=True))


def kind_of(field: attrs.Attribute) -> type:
    return field.metadata.get("kind", str)


def required_keys(options_class: type) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(options_class) if f.default is attrs.NOTHING)


def key_names(options_class: type) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(options_class))


def parse_value(options_class: type, key: str, raw: str) -> Any:
    """The string form's ``raw`` value of ``key`` as the key's type."""
    kind = kind_of(attrs.fields_dict(options_class)[key])
    if kind is bool:
        if raw.lower() in ("true", "false"):
            return raw.lower() == "true"
    elif kind is int:
        try:
            return int(raw)
        except ValueError:
            pass
    elif kind is float:
        try:
            return float(raw)
        except ValueError:
            pass
    else:
        return raw
    raise ValueError(f"speculative config: {key} must be {_KIND_WORDS[kind]}, got {raw!r}")


# ----------------------------------------------------------------------------- keys from a signature
def _kind_from(annotation: Any, default: Any) -> tuple[type, bool]:
    """The key kind of an annotation (``int``, ``int | None``, ...) and whether None is allowed."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        if default is None or default is inspect.Parameter.empty:
            return str, default is None
        return next((k for k in (bool, int, float, str) if isinstance(default, k)), str), False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in KEY_KINDS:
            return rest[0], True
    if annotation in KEY_KINDS:
        return annotation, default is None
    raise TypeError(f"type {annotation!r} is not a speculative-config key type (int, float, bool, str, or | None)")


def _kind_validator(kind: type, optional: bool):
    if kind is bool:
        return boolean(optional=optional)
    if kind is str:
        return non_empty_str(optional=optional)
    return satisfies(is_int if kind is int else is_real, _KIND_WORDS[kind], optional)


def options_from_signature(factory: Callable[..., Any], method: str) -> type:
    """An options class whose keys are ``factory``'s keyword parameters (see the module docstring)."""
    target = factory.__init__ if inspect.isclass(factory) else factory
    signature = inspect.signature(factory)
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # unresolvable string annotations: fall back to the defaults' types
        hints = {}
    common = attrs.fields_dict(CommonOptions)
    fields: dict[str, Any] = {}
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            continue
        if param.name in common:
            base = common[param.name]
            default = attrs.NOTHING if param.name == "num_speculative_tokens" else param.default
            if default is inspect.Parameter.empty:
                default = attrs.NOTHING
            fields[param.name] = option(kind_of(base), base.validator, default=default)
            continue
        kind, optional = _kind_from(hints.get(param.name, param.annotation), param.default)
        default = attrs.NOTHING if param.default is inspect.Parameter.empty else param.default
        fields[param.name] = option(kind, _kind_validator(kind, optional), default=default)
    for name in ENGINE_KEYS:
        if name not in fields:
            base = common[name]
            fields[name] = option(kind_of(base), base.validator, default=base.default)
    if "num_speculative_tokens" not in fields:
        raise TypeError(
            f"the factory of speculative method {method!r} must take a num_speculative_tokens keyword parameter "
            "(or declare an options_class)"
        )
    # Required keys first, so attrs accepts the order; kw_only makes the order irrelevant to callers.
    ordered = dict(sorted(fields.items(), key=lambda kv: kv[1]._default is not attrs.NOTHING))
    name = "".join(part.capitalize() for part in method.replace("-", "_").replace(".", "_").split("_")) + "Options"
    return attrs.make_class(name, ordered, bases=(_Labelled,), frozen=True, kw_only=True)


def options_class_of(factory: Callable[..., Any], method: str) -> type:
    """The factory's declared ``options_class``, else one read off its signature."""
    declared = getattr(factory, "options_class", None)
    if declared is not None:
        if not attrs.has(declared) or "num_speculative_tokens" not in attrs.fields_dict(declared):
            raise TypeError(
                f"{method!r}: options_class must be an attrs class with a num_speculative_tokens field "
                "(subclass specdec.proposers.options.CommonOptions)"
            )
        return declared
    return options_from_signature(factory, method)


def factory_kwargs(factory: Callable[..., Any], options: Any) -> dict[str, Any]:
    """The options that ``factory`` takes as keyword arguments (all of them if it takes ``**kwargs``)."""
    values = attrs.asdict(options, recurse=False)
    params = inspect.signature(factory).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return values
    return {k: v for k, v in values.items() if k in params}


def keys_from(options_class: type):
    """Class decorator: a proposer whose config keys are ``options_class``.

    The class gets it as its ``options_class``, and every construction first validates the arguments
    that are keys with it (defaults filled in, as a config would), so a proposer built by hand is
    checked exactly like one built from a speculative config.
    """
    names = set(attrs.fields_dict(options_class))

    def decorate(cls):
        init = cls.__init__
        signature = inspect.signature(init)

        @functools.wraps(init)
        def checked_init(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            keys = {k: v for k, v in bound.arguments.items() if k in names}
            validated = options_class(**keys)
            bound.arguments.update({k: getattr(validated, k) for k in keys})
            init(*bound.args, **bound.kwargs)

        cls.__init__ = checked_init
        cls.options_class = options_class
        return cls

    return decorate
