"""``SpeculativeConfig``: which proposer drafts, how many tokens, and its per-method keys.

Equivalent user forms, parsed by ``parse_speculative_config``::

    eagle3:model=/ckpt/draft,num_speculative_tokens=3
    {"method": "eagle3", "model": "/ckpt/draft", "num_speculative_tokens": 3}
    SpeculativeConfig(method="eagle3", model="/ckpt/draft", num_speculative_tokens=3)

The method is looked up in the proposer registry (built-ins, :func:`register_proposer`, installed
entry points) and its keys are its options class (``specdec.proposers.options``), so a plug-in is
validated exactly like a built-in. In the string form each value is parsed as its key's type (int,
float, bool ``true``/``false``, or string); a value containing ``,`` needs the JSON/dict form. In the
dict form values must already have the right type.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import attrs

from specdec.proposers.options import key_names, parse_value, required_keys
from specdec.proposers.registry import BUILTIN_METHODS, PROPOSERS, method_options, options_dict
from specdec.registry import UnknownNameError

# The built-in methods (the registry may hold more: see ``available_proposers``).
METHODS: tuple[str, ...] = BUILTIN_METHODS


def _error(message: str) -> ValueError:
    return ValueError(f"speculative config: {message}")


def _options_of(method: Any) -> type:
    if not isinstance(method, str):
        raise _error(PROPOSERS.unknown_message(method))
    try:
        return method_options(method)
    except UnknownNameError as err:
        raise _error(str(err)) from None


def _unknown_key(key: str, method: str, options: type) -> ValueError:
    return _error(f"unknown key {key!r} for method {method!r}; valid keys: {', '.join(key_names(options))}")


@attrs.frozen(init=False)
class SpeculativeConfig:
    """A validated speculative-decoding setup; see PUBLIC_API.md for the method table.

    ``SpeculativeConfig(method=..., **keys)``: ``options`` holds the method's validated keys (its
    options class), each also readable as an attribute (``config.model``, ``config.num_speculative_tokens``);
    a key the method does not take reads None. An unknown method or key, a missing required key or a
    value of the wrong type raises ``ValueError`` naming it and listing the valid choices.
    """

    method: str
    options: Any

    def __init__(self, method: str, **keys: Any):
        options_class = _options_of(method)
        allowed = key_names(options_class)
        for key, value in keys.items():
            if value is not None and key not in allowed:
                raise _error(f"key {key!r} is not accepted by method {method!r}; valid keys: {', '.join(allowed)}")
        required = required_keys(options_class)
        for key in required:
            if keys.get(key) is None:
                raise _error(f"method {method!r} requires {key!r}; required keys: {', '.join(required)}")
        given = {k: v for k, v in keys.items() if v is not None}
        self.__attrs_init__(method, options_class(**given))

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not attributes: the method's keys, or None for others.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.options, name, None)

    @property
    def num_speculative_tokens(self) -> int:
        return self.options.num_speculative_tokens

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> "SpeculativeConfig":
        """Build from ``{"method": ..., key: value, ...}``; values must have their key's type."""
        if "method" not in value:
            raise _error(f"missing 'method'; valid methods: {', '.join(PROPOSERS.names())}")
        method = value["method"]
        options_class = _options_of(method)
        allowed = key_names(options_class)
        for key in value:
            if key != "method" and key not in allowed:
                raise _unknown_key(key, method, options_class)
        return cls(**dict(value))

    @classmethod
    def from_string(cls, text: str) -> "SpeculativeConfig":
        """Parse ``method:key=value,...`` or a JSON object."""
        text = text.strip()
        if not text:
            raise _error(
                f"empty string; write e.g. 'ngram:num_speculative_tokens=3' (methods: {', '.join(PROPOSERS.names())})"
            )
        if text.startswith("{"):
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _error(f"invalid JSON ({exc.msg} at character {exc.pos})") from None
            if not isinstance(parsed, dict):
                raise _error("JSON form must be an object")
            return cls.from_dict(parsed)
        method, _, rest = text.partition(":")
        method = method.strip()
        options_class = _options_of(method)
        allowed = key_names(options_class)
        fields: dict[str, Any] = {"method": method}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, eq, raw = item.partition("=")
            key, raw = key.strip(), raw.strip()
            if not eq:
                raise _error(f"expected key=value, got {item!r}")
            if key not in allowed:
                raise _unknown_key(key, method, options_class)
            if key in fields:
                raise _error(f"key {key!r} given twice")
            fields[key] = parse_value(options_class, key, raw)
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """The method and every key that is set (the dict form; round-trips through from_dict)."""
        return {"method": self.method, **options_dict(self.options)}

    def to_string(self) -> str:
        """The ``method:key=value,...`` form (round-trips through from_string)."""
        items = [
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.to_dict().items() if k != "method"
        ]
        return f"{self.method}:{','.join(items)}"


def parse_speculative_config(value: None | str | Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig | None:
    """Normalise every accepted form (None, string, JSON string, dict, SpeculativeConfig)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        return SpeculativeConfig.from_string(value)
    if isinstance(value, Mapping):
        return SpeculativeConfig.from_dict(value)
    raise _error(f"expected None, a string, a dict or a SpeculativeConfig, got {type(value).__name__}")
