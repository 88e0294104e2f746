"""Per-request sampling parameters (the user-facing ``SamplingParams``)."""

from __future__ import annotations

from typing import Any

import attrs

from specdec.validation import boolean, int_at_least, int_in_range, is_int, number_at_least, number_in


def _to_stop_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(
            f"SamplingParams.stop_token_ids must be None or a list of token ids, got {value!r}"
        )
    ids = tuple(value)
    bad = [t for t in ids if not (is_int(t) and t >= 0)]
    if bad:
        raise ValueError(f"SamplingParams.stop_token_ids must hold ints >= 0, got {bad[0]!r}")
    return ids


def _to_stop_strings(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    strings = (value,) if isinstance(value, str) else value
    if not hasattr(strings, "__iter__") or isinstance(strings, bytes):
        raise ValueError(f"SamplingParams.stop must be None, a string or a list of strings, got {value!r}")
    strings = tuple(strings)
    if not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {value!r}")
    return strings


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
    - ``stop``: strings that end the output before their first occurrence in the detokenized text
      (not returned; ``finish_reason`` ``"stop"``); needs a tokenizer.
    - ``logprobs``: per generated token, the log-probability of the chosen token and of the
      ``logprobs`` most likely ones (None = off, 0 = the chosen token only), from the model's
      unprocessed distribution; ``prompt_logprobs`` likewise for every prompt token after the first.
    """

    max_tokens: int = attrs.field(default=16, validator=int_at_least(1))
    temperature: float = attrs.field(default=0.0, validator=number_at_least(0, meaning="0 = greedy"))
    top_p: float = attrs.field(default=1.0, validator=number_in(0, 1, meaning="1 = off"))
    top_k: int = attrs.field(default=0, validator=int_at_least(0, meaning="0 = off"))
    seed: int | None = attrs.field(
        default=None, validator=int_in_range(-(2**63), 2**64, optional=True, what="a 64-bit int")
    )
    stop_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_to_stop_ids)
    ignore_eos: bool = attrs.field(default=False, validator=boolean())
    stop: tuple[str, ...] | None = attrs.field(default=None, converter=_to_stop_strings)
    logprobs: int | None = attrs.field(default=None, validator=int_at_least(0, optional=True))
    prompt_logprobs: int | None = attrs.field(default=None, validator=int_at_least(0, optional=True))

    @classmethod
    def _field_label(cls, name: str) -> str:
        return f"SamplingParams.{name}"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
