"""``SpeculativeConfig``: which proposer drafts, how many tokens, and its per-method settings.

Two equivalent user forms are parsed by ``parse_speculative_config``::

    eagle3:model=/ckpt/draft,num_speculative_tokens=3
    {"method": "eagle3", "model": "/ckpt/draft", "num_speculative_tokens": 3}

In the string form each value is parsed as its key's type (int, bool ``true``/``false``, or
string); a value containing ``,`` needs the JSON/dict form. In the dict form values must already
have the right type.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import attrs

METHODS: tuple[str, ...] = ("ngram", "draft_model", "eagle3", "eagle3.1-mla", "eagle3-unshifted")

# Keys every method accepts, and the extra keys each method accepts.
COMMON_KEYS: tuple[str, ...] = ("num_speculative_tokens", "attention_backend", "block_size")
METHOD_KEYS: dict[str, tuple[str, ...]] = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "draft_model": ("model",),
    "eagle3": ("model",),
    "eagle3.1-mla": ("model",),
    "eagle3-unshifted": ("model", "kv_sharing", "kv_sharing_target_layer"),
}
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "ngram": ("num_speculative_tokens",),
    "draft_model": ("num_speculative_tokens", "model"),
    "eagle3": ("num_speculative_tokens", "model"),
    "eagle3.1-mla": ("num_speculative_tokens", "model"),
    "eagle3-unshifted": ("num_speculative_tokens", "model"),
}
KEY_TYPES: dict[str, type] = {
    "num_speculative_tokens": int,
    "model": str,
    "prompt_lookup_min": int,
    "prompt_lookup_max": int,
    "kv_sharing": bool,
    "kv_sharing_target_layer": int,
    "attention_backend": str,
    "block_size": int,
}
# Int keys that count from 0 (layer indices); every other int key must be >= 1.
ZERO_BASED_KEYS: tuple[str, ...] = ("kv_sharing_target_layer",)
# vLLM's choice: with neither bound given both are 5; with one given the other copies it.
NGRAM_DEFAULT_LOOKUP = 5


def valid_keys(method: str) -> tuple[str, ...]:
    """Every key ``method`` accepts (besides ``method`` itself)."""
    return COMMON_KEYS + METHOD_KEYS[method]


def _error(message: str) -> ValueError:
    return ValueError(f"speculative config: {message}")


def _unknown_key(key: str, method: str) -> ValueError:
    return _error(f"unknown key {key!r} for method {method!r}; valid keys: {', '.join(valid_keys(method))}")


def _check_type(key: str, value: Any) -> None:
    want = KEY_TYPES[key]
    if want is int:
        lowest = 0 if key in ZERO_BASED_KEYS else 1
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= lowest
        if not ok:
            raise _error(f"{key} must be an int >= {lowest}, got {value!r}")
    elif want is bool:
        if not isinstance(value, bool):
            raise _error(f"{key} must be true or false, got {value!r}")
    elif not (isinstance(value, str) and value):
        raise _error(f"{key} must be a non-empty string, got {value!r}")


def _model_path(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


@attrs.frozen
class SpeculativeConfig:
    """A validated speculative-decoding setup; see PUBLIC_API.md for the method table.

    - ``method``: one of ``METHODS``.
    - ``num_speculative_tokens``: drafts per step, k >= 1 (required).
    - ``model``: draft checkpoint folder (required by every method but ``ngram``).
    - ``prompt_lookup_min`` / ``prompt_lookup_max``: ngram only; shortest and longest suffix
      n-gram to look up. Defaults as vLLM: both 5, or the given one copied to the other.
    - ``kv_sharing``: eagle3-unshifted only; the draft reads the target's KV at prompt positions
      instead of computing its own (default true).
    - ``kv_sharing_target_layer``: eagle3-unshifted with kv_sharing only; the target layer (0-based)
      whose KV the draft's one layer reads. Default: the draft config's
      ``eagle_config.kv_sharing_target_layers`` (what it was trained with), else the last target
      layer whose KV layout matches the draft's.
    - ``attention_backend``: the draft's backend (default: the target's).
    - ``block_size``: the draft pool's page size (default: what its backend prefers).
    """

    method: str
    num_speculative_tokens: int | None = None
    model: str | None = attrs.field(default=None, converter=_model_path)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    kv_sharing: bool | None = None
    kv_sharing_target_layer: int | None = None
    attention_backend: str | None = None
    block_size: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.method not in METHODS:
            raise _error(f"unknown method {self.method!r}; valid methods: {', '.join(METHODS)}")
        allowed = valid_keys(self.method)
        for key in KEY_TYPES:
            value = getattr(self, key)
            if value is None:
                continue
            if key not in allowed:
                raise _error(
                    f"key {key!r} is not accepted by method {self.method!r}; valid keys: {', '.join(allowed)}"
                )
            _check_type(key, value)
        for key in REQUIRED_KEYS[self.method]:
            if getattr(self, key) is None:
                required = ", ".join(REQUIRED_KEYS[self.method])
                raise _error(f"method {self.method!r} requires {key!r}; required keys: {required}")
        if self.method == "ngram":
            lo = self.prompt_lookup_min or self.prompt_lookup_max or NGRAM_DEFAULT_LOOKUP
            hi = self.prompt_lookup_max or self.prompt_lookup_min or NGRAM_DEFAULT_LOOKUP
            if lo > hi:
                raise _error(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            # Frozen class: filling defaults at construction is the one sanctioned mutation.
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        if self.method == "eagle3-unshifted" and self.kv_sharing is None:
            object.__setattr__(self, "kv_sharing", True)
        if self.kv_sharing_target_layer is not None and not self.kv_sharing:
            raise _error("kv_sharing_target_layer needs kv_sharing=true (without sharing the draft reads no target "
                         "layer); drop it or set kv_sharing=true")

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> "SpeculativeConfig":
        """Build from ``{"method": ..., key: value, ...}``; values must have their key's type."""
        if "method" not in value:
            raise _error(f"missing 'method'; valid methods: {', '.join(METHODS)}")
        method = value["method"]
        if method not in METHODS:
            raise _error(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")
        for key in value:
            if key != "method" and key not in valid_keys(method):
                raise _unknown_key(key, method)
        return cls(**dict(value))

    @classmethod
    def from_string(cls, text: str) -> "SpeculativeConfig":
        """Parse ``method:key=value,...`` or a JSON object."""
        text = text.strip()
        if not text:
            raise _error(f"empty string; write e.g. 'ngram:num_speculative_tokens=3' (methods: {', '.join(METHODS)})")
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
        if method not in METHODS:
            raise _error(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")
        fields: dict[str, Any] = {"method": method}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, eq, raw = item.partition("=")
            key, raw = key.strip(), raw.strip()
            if not eq:
                raise _error(f"expected key=value, got {item!r}")
            if key not in valid_keys(method):
                raise _unknown_key(key, method)
            if key in fields:
                raise _error(f"key {key!r} given twice")
            fields[key] = _parse_value(key, raw)
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """The method and every key that is set (the dict form; round-trips through from_dict)."""
        out: dict[str, Any] = {"method": self.method}
        out.update({k: getattr(self, k) for k in KEY_TYPES if getattr(self, k) is not None})
        return out

    def to_string(self) -> str:
        """The ``method:key=value,...`` form (round-trips through from_string)."""
        items = [
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.to_dict().items() if k != "method"
        ]
        return f"{self.method}:{','.join(items)}"


def _parse_value(key: str, raw: str) -> Any:
    want = KEY_TYPES[key]
    if want is int:
        try:
            return int(raw)
        except ValueError:
            raise _error(f"{key} must be an int, got {raw!r}") from None
    if want is bool:
        if raw.lower() in ("true", "false"):
            return raw.lower() == "true"
        raise _error(f"{key} must be true or false, got {raw!r}")
    return raw


def parse_speculative_config(value: None | str | Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig | None:
    """Normalise every accepted form (None, string, JSON string, dict, SpeculativeConfig)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        return SpeculativeConfig.from_string(value)
    if isinstance(value, Mapping):
        return SpeculativeConfig.from_dict(value)
    raise _error(f"expected None, a string, a dict or a SpeculativeConfig, got {type(value).__name__}")
