"""What front ends read: ``LLM.generate``'s result per prompt, and what each engine step did."""

from __future__ import annotations

from typing import Sequence

import attrs


@attrs.frozen
class RequestOutput:
    """One prompt's result.

    - ``prompt_token_ids``: the prompt as token ids (encoded when it was given as text).
    - ``token_ids``: the generated ids, including the stop token that ended it, if any.
    - ``text``: ``token_ids`` decoded (special tokens skipped); None without a tokenizer.
    - ``finish_reason``: ``"stop"`` (EOS, a ``stop_token_ids`` entry or a ``stop`` string) or
      ``"length"`` (``max_tokens`` or ``max_model_len`` reached).
    - ``logprobs`` / ``prompt_logprobs``: one :class:`TokenLogprob` per generated token / per prompt
      token after the first, when ``SamplingParams`` asked for them (else None).
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list["TokenLogprob"] | None = None
    prompt_logprobs: tuple["TokenLogprob", ...] | None = None

    def as_dict(self) -> dict:
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
        }


@attrs.frozen
class RequestStep:
    """One request's part of an engine step (what :meth:`LLMEngine.step` returns per request).

    - ``request_id``: the engine's id of the request; ``index``: its position in the caller's input.
    - ``new_token_ids``: the tokens appended to its output this step (accepted drafts plus one token,
      cut after a stop token); ``draft_token_ids``: the drafts it was given (empty without), of which
      the first ``num_accepted`` were accepted; ``num_drafts_chosen``: how many it was allowed
      (``num_speculative_tokens`` or fewer near its end; with ``adaptive``, the controller's choice; the
      proposer may draft fewer).
    - ``finish_reason``: None while it runs, else ``"stop"``, ``"length"`` or ``"abort"``.
    - ``logprobs``: one :class:`TokenLogprob` per new token when the request asked for them;
      ``prompt_logprobs``: in the step that computed the prompt (again after a preemption's recompute),
      one per prompt token after the first.
    """

    request_id: int
    index: int
    new_token_ids: tuple[int, ...]
    draft_token_ids: tuple[int, ...] = ()
    num_accepted: int = 0
    finish_reason: str | None = None
    num_drafts_chosen: int = 0
    logprobs: tuple["TokenLogprob", ...] | None = None
    prompt_logprobs: tuple["TokenLogprob", ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen
class StepOutput:
    """What one engine step did: ``step`` counts the target forwards before it (a step that ran no
    forward, everything preempted, reports no requests)."""

    step: int
    requests: tuple[RequestStep, ...] = ()

    @property
    def finished(self) -> tuple[RequestStep, ...]:
        return tuple(r for r in self.requests if r.finished)


def trace_entries(steps: Sequence[StepOutput]) -> list[dict]:
    """One dict per step and request that had drafts, in order (the CLI's ``--trace``): ``step`` (counted
    from the first of ``steps``), ``request`` (input index), ``num_drafts_chosen``, ``draft_token_ids``,
    ``num_accepted``, ``emitted_token_ids``."""
    if not steps:
        return []
    first = steps[0].step
    return [
        {
            "step": out.step - first,
            "request": r.index,
            "num_drafts_chosen": r.num_drafts_chosen,
            "draft_token_ids": list(r.draft_token_ids),
            "num_accepted": r.num_accepted,
            "emitted_token_ids": list(r.new_token_ids),
        }
        for out in steps
        for r in out.requests
        if r.draft_token_ids
    ]


@attrs.frozen
class TokenLogprob:
    """A token's log-probability and the ``top`` most likely alternatives at its position, each
    ``(token_id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
