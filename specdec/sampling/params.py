"""Per-request sampling parameters (the user-facing ``SamplingParams``)."""

from __future__ import annotations

import math
from typing import Any

import attrs


def _is_int(value: Any) -> bool:
    # bool is an int subclass; ``max_tokens=True`` is a mistake, not the number 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _check_max_tokens(_inst: Any, _attr: Any, value: Any) -> None:
    if not (_is_int(value) and value >= 1):
        raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {value!r}")


def _check_temperature(_inst: Any, _attr: Any, value: Any) -> None:
    if not (_is_real(value) and value >= 0):
        raise ValueError(
            f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got {value!r}"
        )


def _check_top_p(_inst: Any, _attr: Any, value: Any) -> None:
    if not (_is_real(value) and 0 < value <= 1):
        raise ValueError(f"SamplingParams.top_p must be a number in (0, 1] (1 = off), got {value!r}")


def _check_top_k(_inst: Any, _attr: Any, value: Any) -> None:
    if not (_is_int(value) and value >= 0):
        raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {value!r}")


def _check_seed(_inst: Any, _attr: Any, value: Any) -> None:
    if value is not None and not (_is_int(value) and -(2**63) <= value < 2**64):
        raise ValueError(f"SamplingParams.seed must be None or a 64-bit int, got {value!r}")


def _to_stop_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(
            f"SamplingParams.stop_token_ids must be None or a list of token ids, got {value!r}"
        )
    ids = tuple(value)
    bad = [t for t in ids if not (_is_int(t) and t >= 0)]
    if bad:
        raise ValueError(f"SamplingParams.stop_token_ids must hold ints >= 0, got {bad[0]!r}")
    return ids


def _check_bool(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"SamplingParams.{attr.name} must be True or False, got {value!r}")


@attrs.frozen
class SamplingParams:
    """How one request is sampled; validated at construction.

    - ``max_tokens``: generated tokens at most (>= 1).
    - ``temperature``: 0 means greedy (argmax); otherwise logits are divided by it.
    - ``top_k``: keep the k most likely tokens (0 = off; ties at the k-th value are all kept).
    - ``top_p``: keep the smallest set of most likely tokens whose mass reaches ``top_p`` (1 = off).
      Temperature is applied first, then top-k, then top-p (vLLM's order).
    - ``seed``: makes the request reproducible whatever else shares its batch. Requests without
      one get a seed assigned by the engine (see ``SamplingBatch.from_params``).
    - ``stop_token_ids``: generation stops after emitting any of these (kept as a tuple).
    - ``ignore_eos``: keep generating past the tokenizer's EOS.
    """

    max_tokens: int = attrs.field(default=16, validator=_check_max_tokens)
    temperature: float = attrs.field(default=0.0, validator=_check_temperature)
    top_p: float = attrs.field(default=1.0, validator=_check_top_p)
    top_k: int = attrs.field(default=0, validator=_check_top_k)
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    stop_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_to_stop_ids)
    ignore_eos: bool = attrs.field(default=False, validator=_check_bool)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
