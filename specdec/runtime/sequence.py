"""One request's tokens, limits and lifecycle inside the engine."""

from __future__ import annotations

import enum
from typing import Iterable, Sequence as TypingSequence

from specdec.sampling.params import SamplingParams
from specdec.validation import is_int


def checked_prompt(token_ids: Iterable[int], vocab_size: int, max_model_len: int, index: int = 0) -> list[int]:
    """Prompt ``index``'s token ids as a list, or ``ValueError`` (one line, naming the fix) when it is
    empty, holds ids outside the vocabulary or leaves no room to generate within ``max_model_len``."""
    ids = list(token_ids)
    if not ids:
        raise ValueError(f"prompt {index} is empty; give at least one token")
    if not all(is_int(t) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt {index} holds token ids outside the vocabulary 0..{vocab_size - 1}")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt {index} has {len(ids)} tokens, max_model_len is {max_model_len}: "
            "shorten the prompt or raise max_model_len"
        )
    return ids


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV pages
    FINISHED = "finished"


class Sequence:
    """A request: its prompt, the tokens generated so far, and when it must stop.

    ``token_ids`` is prompt + output. ``max_len`` is the total length at which it stops for
    ``"length"`` (``max_tokens`` capped by ``max_model_len``). The last token is never in the KV
    cache before the next forward: a request that was computed up to now has ``len(token_ids) - 1``
    cached tokens, and a preempted one has none (it is recomputed as a prefill of all its tokens).
    """

    __slots__ = (
        "seq_id",
        "index",
        "token_ids",
        "num_prompt_tokens",
        "params",
        "seed",
        "stop_ids",
        "max_len",
        "status",
        "finish_reason",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: TypingSequence[int],
        params: SamplingParams,
        *,
        seed: int,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int,
        index: int = 0,
    ):
        self.seq_id = seq_id
        self.index = index  # position in the caller's input list (for outputs and traces)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.seed = seed
        stops = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stops.update(eos_token_ids)
        self.stop_ids = frozenset(stops)
        self.max_len = min(self.num_prompt_tokens + params.max_tokens, max_model_len)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def max_drafts(self, k: int) -> int:
        """Drafts this request may get now: emitted tokens (drafts + 1) never pass ``max_len``."""
        return max(0, min(k, self.max_len - len(self.token_ids) - 1))

    def max_kv_tokens(self) -> int:
        """The most tokens this request ever holds in any pool (its last token is never cached)."""
        return max(self.num_prompt_tokens, self.max_len - 1)

    def append(self, tokens: TypingSequence[int]) -> int:
        """Append emitted tokens in order until a stop condition; returns how many were kept."""
        kept = 0
        for token in tokens:
            self.token_ids.append(token)
            kept += 1
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self.max_len:
                self.finish_reason = "length"
            else:
                continue
            self.status = SequenceStatus.FINISHED
            break
        return kept

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, max_len={self.max_len})"
        )
