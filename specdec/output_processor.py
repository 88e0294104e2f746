"""From engine steps to what a front end returns: each request's tokens, text, logprobs and its own
speculation figures, with stop strings applied.

The engine works in tokens; text (and so stop strings) is the front end's. ``LLM.generate`` and the
server both feed every :class:`~specdec.outputs.StepOutput` to an :class:`OutputProcessor` and end,
with ``finish_reason`` ``"stop"``, the requests it reports a stop string ended (the engine may have
emitted tokens past the stop in the same step: they are dropped here, with their logprobs).
"""

from __future__ import annotations

from typing import Sequence

import attrs

from specdec.outputs import RequestOutput, RequestStep, StepOutput, TokenLogprob
from specdec.sampling.params import SamplingParams
from specdec.spec_stats import SpecStats
from specdec.text import TextStream


@attrs.define
class RequestState:
    """One request's output so far (see :class:`OutputProcessor`).

    ``spec`` counts the steps that gave it drafts, with vLLM's definitions (``specdec.spec_stats``), so a
    response can carry its own figures.
    """

    request_id: int
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: TextStream | None
    token_ids: list[int] = attrs.Factory(list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    spec: SpecStats = attrs.Factory(SpecStats)
    _sent_tokens: int = 0
    _sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str | None:
        return self.stream.text if self.stream is not None else None

    def observe(self, step: RequestStep) -> bool:
        """Add one step's part; True when a stop string ended the output in it."""
        if self.finished:
            return False  # tokens of steps after a stop, before the engine heard of it
        if step.draft_token_ids:
            self.spec.observe([len(step.draft_token_ids)], [step.num_accepted])
        if step.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = step.prompt_logprobs
        new = list(step.new_token_ids)
        stopped = False
        if self.stream is not None:
            self.stream.push(new)
            stopped = self.stream.stopped
            new = new[: self.stream.num_tokens - len(self.token_ids)]
        self.token_ids += new
        if step.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(step.logprobs[: len(new)])
        if stopped:
            self.finish_reason = "stop"
        elif step.finished:
            self.finish_reason = step.finish_reason
            if self.stream is not None:
                self.stream.finish()
        return stopped and not step.finished

    def new_tokens(self) -> tuple[list[int], list[TokenLogprob] | None]:
        """Tokens (and their logprobs) added since the last call, for streaming."""
        start, self._sent_tokens = self._sent_tokens, len(self.token_ids)
        logprobs = self.logprobs[start:] if self.logprobs is not None else None
        return self.token_ids[start:], logprobs

    def take_prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The prompt's logprobs the first time they are there, for streaming (None otherwise)."""
        if self.prompt_logprobs is None or self._sent_prompt_logprobs:
            return None
        self._sent_prompt_logprobs = True
        return self.prompt_logprobs

    def output(self) -> RequestOutput:
        return RequestOutput(
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.token_ids),
            text=self.text,
            finish_reason=self.finish_reason,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


class OutputProcessor:
    """The :class:`RequestState` of every request a front end added, updated step by step."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[int, RequestState] = {}

    def add(self, request_id: int, index: int, prompt_token_ids: Sequence[int], params: SamplingParams) -> RequestState:
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {index} has stop strings, but the model folder has no tokenizer to read "
                             "text with; use stop_token_ids")
        stream = TextStream(self.tokenizer, params.stop or ()) if self.tokenizer is not None else None
        state = RequestState(request_id, index, list(prompt_token_ids), params, stream)
        self.requests[request_id] = state
        return state

    def process(self, step: StepOutput) -> list[int]:
        """Take one step; returns the ids of the requests a stop string ended that the engine still runs."""
        stopped = []
        for part in step.requests:
            state = self.requests.get(part.request_id)
            if state is not None and state.observe(part):
                stopped.append(part.request_id)
        return stopped
