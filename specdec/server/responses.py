"""Response bodies in OpenAI's shapes: completion and chat choices, their logprobs, usage and the
per-request speculation figures (vLLM's ``metrics.speculative_decoding``)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Sequence

import attrs

from specdec.outputs import TokenLogprob
from specdec.server.engine_core import Delta
from specdec.spec_stats import SpecStats


@attrs.define
class Choice:
    """One choice's output, accumulated from its deltas."""

    text: str = ""
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    spec: SpecStats | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason, self.num_prompt_tokens, self.spec = (
                delta.finish_reason, delta.num_prompt_tokens, delta.spec)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(choices: Sequence[Choice], prompt_lens: Sequence[int]) -> dict[str, int]:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def spec_metrics(choices: Sequence[Choice], num_speculative_tokens: int, detailed: bool) -> dict[str, Any]:
    """The request's own speculation figures, summed over its choices (vLLM's definitions and names)."""
    total = SpecStats.for_k(num_speculative_tokens)
    for choice in choices:
        if choice.spec is not None:
            total.add(choice.spec)
    out = {
        "mean_acceptance_length": total.mean_acceptance_length,
        "draft_acceptance_rate": total.draft_acceptance_rate,
        "num_spec_steps": total.num_drafts,
        "num_draft_tokens": total.num_draft_tokens,
        "num_accepted_draft_tokens": total.num_accepted_tokens,
        "num_spec_tokens": num_speculative_tokens,
        "accepted_per_position": list(total.accepted_per_position),
    }
    if detailed:
        out["acceptance_per_position"] = total.acceptance_per_position
    return {"speculative_decoding": out}


class TokenText:
    """Token strings as OpenAI shows them: each token decoded alone."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def completion_logprobs(entries: Sequence[TokenLogprob | None], token_text: TokenText, text_start: int = 0
                        ) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; an entry of None (the echoed first prompt token) has no
    logprob. ``top_logprobs`` holds the chosen token and the most likely ones."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_start
    for entry, token_id in entries:
        piece = token_text(token_id)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {token_text(t): lp for t, lp in entry.top}
        top.setdefault(piece, entry.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def completion_entries(choice: Choice, prompt_ids: Sequence[int], echo: bool) -> list[tuple]:
    """(logprob entry or None, token id) of the echoed prompt (if any) and the generated tokens."""
    entries = []
    if echo:
        prompt = list(choice.prompt_logprobs or ())
        entries.append((None, prompt_ids[0]))
        entries += [(lp, lp.token_id) for lp in prompt]
    entries += [(lp, lp.token_id) for lp in (choice.logprobs or ())]
    return entries


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """The chat ``logprobs`` object: per token its text, logprob, bytes and the top alternatives."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}
