"""The OpenAI-compatible request bodies (pydantic models, validated by FastAPI) and the error object.

Fields follow OpenAI's API with vLLM's extensions (``top_k``, ``ignore_eos``, ``stop_token_ids``), plus
``spec_decode_metrics`` (the request's own speculation figures in its response). Unknown fields are
ignored, as OpenAI's clients and lm_eval send some (``do_sample``...). A body that does not validate is
answered 400 with OpenAI's error object naming the field (``param``).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdec.sampling.params import SamplingParams

# OpenAI's limit on the alternatives returned per position.
MAX_LOGPROBS = 20


def error_body(message: str, status: int, *, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, with the type names vLLM uses."""
    types = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 503: "ServiceUnavailableError",
             500: "InternalServerError"}
    return {"error": {"message": message, "type": kind or types.get(status, "Error"), "param": param, "code": status}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    spec_decode_metrics: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported; leave them 0")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        strings = [value] if isinstance(value, str) else value
        if strings is not None and not all(strings):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling_params(self, max_tokens: int, *, logprobs: int | None, prompt_logprobs: int | None,
                        choice: int = 0) -> SamplingParams:
        """The engine's parameters for choice ``choice`` (of ``n``): a seeded request's choices get seeds
        ``seed + choice``, so they differ yet reproduce."""
        seed = None if self.seed is None else (self.seed + choice) % 2**64
        return SamplingParams(
            max_tokens=max(1, max_tokens),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(0, self.top_k),
            seed=seed,
            stop=self.stop or None,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False  # vLLM's extension: each choice (and chunk) carries its token ids

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list: each a string or a list of token ids."""
        value = self.prompt
        if isinstance(value, str):
            return [value]
        if all(isinstance(x, int) for x in value):
            return [list(value)]
        return list(value)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
