"""The OpenAI-compatible HTTP API (FastAPI) over an :class:`~specdec.server.async_engine.AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info``, ``GET /health``, ``GET /metrics``. Errors are OpenAI's
error object: 400 for a body or value that cannot be served (naming the field), 401 for a missing or
wrong API key, 404 for another model's name, 503 past the request limit, 500 when the engine failed
the request. A client that disconnects, streaming or not, has its requests aborted at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from specdec.server.async_engine import AsyncEngine, Unavailable
from specdec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from specdec.server.responses import (
    Choice,
    TokenText,
    chat_logprobs,
    completion_entries,
    completion_logprobs,
    new_id,
    now,
    spec_metrics,
    usage,
)

STREAM_GRACE_SECONDS = 30.0  # an in-flight stream may finish this long after a shutdown signal


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def create_app(server) -> FastAPI:
    """The app for a :class:`~specdec.server.launch.Server` (args, tokenizer, engine, metrics)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        server.engine.start()
        try:
            yield
        finally:
            server.engine.stop()

    app = FastAPI(title="specdec", lifespan=lifespan)
    api = _Routes(server)

    @app.exception_handler(APIError)
    async def _api_error(_request, err: APIError):
        return JSONResponse(error_body(err.message, err.status, param=err.param), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, loc = "the request body is not valid JSON", []
        param = ".".join(loc) or None
        return JSONResponse(error_body(f"{param}: {message}" if param else message, 400, param=param),
                            status_code=400)

    if server.args.api_key:
        app.add_middleware(_RequireAPIKey, key=server.args.api_key)

    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)
    app.get("/v1/models")(api.models)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.get("/tokenizer_info")(api.tokenizer_info)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics)
    return app


class _RequireAPIKey:
    """401 for a ``/v1`` request without ``Authorization: Bearer KEY`` (compared in constant time).

    A plain ASGI middleware: it looks at the request's headers only and passes everything else through
    untouched (starlette's ``BaseHTTPMiddleware`` would re-stream every SSE chunk through a memory stream).
    """

    def __init__(self, app, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(error_body("missing or wrong API key (Authorization: Bearer KEY)", 401),
                                        status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Routes:
    def __init__(self, server):
        self.server = server
        self.args = server.args
        self.tokenizer = server.tokenizer
        self.engine: AsyncEngine = server.engine
        self.token_text = TokenText(server.tokenizer)

    # ----- small routes -----
    async def models(self):
        return {"object": "list", "data": [{
            "id": self.args.model_name, "object": "model", "created": now(), "owned_by": "specdec",
            "root": self.args.model, "max_model_len": self.server.max_model_len,
            "speculative_config": spec.to_dict() if (spec := self.args.speculative_config) is not None else None}]}

    async def health(self):
        if not self.server.engine_alive():
            return JSONResponse(error_body("the engine is not running", 503), status_code=503)
        return Response(status_code=200)

    async def metrics(self):
        return Response(self.server.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, body: TokenizeRequest):
        self._check_model(body.model)
        if body.messages is not None:
            ids = self._chat_prompt(body.messages, True)
        else:
            ids = self._encode(body.prompt or "", "prompt", add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.server.max_model_len}

    async def detokenize(self, body: DetokenizeRequest):
        self._check_model(body.model)
        tok = self._require_tokenizer("tokens")
        if any(not 0 <= t < len(tok) for t in body.tokens):
            raise APIError(400, f"tokens must be ids in 0..{len(tok) - 1}", "tokens")
        return {"prompt": tok.decode(body.tokens)}

    async def tokenizer_info(self):
        tok = self._require_tokenizer(None)
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": tok.chat_template,
                "model_max_length": self.server.max_model_len}

    # ----- completions -----
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        prompts = [self._prompt_ids(p) for p in body.prompts()]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        for ids in prompts:
            self._check_length(len(ids), max_tokens, "max_tokens")
        want_logprobs = body.logprobs
        params = [body.sampling_params(max_tokens, logprobs=want_logprobs,
                                       prompt_logprobs=want_logprobs if body.echo else None, choice=j)
                  for j in range(body.n)]
        jobs = [(ids, params[j]) for ids in prompts for j in range(body.n)]
        prompt_of = [ids for ids in prompts for _ in range(body.n)]
        created, rid = now(), new_id("cmpl")
        drop_generated = max_tokens == 0  # echo-only: the one token the engine ran is not returned

        if body.stream:
            return self._stream(request, jobs, "text_completion", rid, created, body, self._completion_chunks(
                body, prompt_of, drop_generated, want_logprobs))
        choices = await self._run(request, jobs)
        out = []
        for index, choice in enumerate(choices):
            if drop_generated:
                choice.text, choice.logprobs = "", []
                choice.token_ids = []
            text = (self._text(prompt_of[index]) if body.echo else "") + choice.text
            logprobs = None
            if want_logprobs is not None:
                logprobs = completion_logprobs(completion_entries(choice, prompt_of[index], body.echo),
                                               self.token_text)
            entry = {"index": index, "text": text, "logprobs": logprobs,
                     "finish_reason": _finish(choice, drop_generated)}
            if body.return_token_ids:
                entry.update(prompt_token_ids=prompt_of[index], token_ids=choice.token_ids)
            out.append(entry)
        result = {"id": rid, "object": "text_completion", "created": created, "model": self.args.model_name,
                  "choices": out, "usage": usage(choices, [len(p) for p in prompt_of])}
        return self._with_spec(result, choices, body)

    def _completion_chunks(self, body, prompt_of, drop_generated, want_logprobs):
        def chunk(index: int, choice: Choice, delta, first: bool) -> dict[str, Any]:
            text = "" if drop_generated else delta.text
            entries = [] if drop_generated else [(lp, lp.token_id) for lp in (delta.logprobs or ())]
            if body.echo and first:
                text = self._text(prompt_of[index]) + text
                prompt = delta.prompt_logprobs or choice.prompt_logprobs or ()
                entries = [(None, prompt_of[index][0]), *((lp, lp.token_id) for lp in prompt), *entries]
            logprobs = completion_logprobs(entries, self.token_text) if want_logprobs is not None else None
            finish = _finish(choice, drop_generated) if delta.finished else None
            part = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if body.return_token_ids:
                part["token_ids"] = [] if drop_generated else list(delta.token_ids)
                if first:
                    part["prompt_token_ids"] = prompt_of[index]
            return part

        return chunk

    # ----- chat -----
    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        ids = self._chat_prompt(body.messages, body.add_generation_prompt)
        limit = body.max_completion_tokens or body.max_tokens
        max_tokens = limit if limit is not None else self.server.max_model_len - len(ids)
        self._check_length(len(ids), max_tokens, "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        jobs = [(ids, body.sampling_params(max_tokens, logprobs=top, prompt_logprobs=None, choice=j))
                for j in range(body.n)]
        created, rid = now(), new_id("chatcmpl")
        if body.stream:
            def chunk(index: int, choice: Choice, delta, first: bool) -> dict[str, Any]:
                message = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
                logprobs = chat_logprobs(delta.logprobs or (), self.token_text) if body.logprobs else None
                return {"index": index, "delta": message, "logprobs": logprobs,
                        "finish_reason": choice.finish_reason if delta.finished else None}

            return self._stream(request, jobs, "chat.completion.chunk", rid, created, body, chunk)
        choices = await self._run(request, jobs)
        out = [{"index": i, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs or (), self.token_text) if body.logprobs else None,
                "finish_reason": c.finish_reason} for i, c in enumerate(choices)]
        result = {"id": rid, "object": "chat.completion", "created": created, "model": self.args.model_name,
                  "choices": out, "usage": usage(choices, [len(ids)] * len(choices))}
        return self._with_spec(result, choices, body)

    # ----- running requests -----
    async def _submit_all(self, jobs, sink: asyncio.Queue) -> list[int]:
        ids: list[int] = []
        try:
            for index, (prompt, params) in enumerate(jobs):
                ids.append(await self.engine.submit(prompt, params, sink, index))
        except Unavailable as err:
            self._abort(ids)
            raise APIError(503, str(err)) from None
        except ValueError as err:
            self._abort(ids)
            raise APIError(400, str(err).splitlines()[0], "prompt") from None
        return ids

    async def _run(self, request: Request, jobs) -> list[Choice]:
        """Run every job to its end; the client going away aborts them all."""
        sink: asyncio.Queue = asyncio.Queue()
        ids = await self._submit_all(jobs, sink)
        choices = [Choice() for _ in jobs]
        collect = asyncio.ensure_future(self._collect(sink, choices))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                self._abort(ids)
        if not collect.done() or collect.cancelled():
            raise APIError(499, "the client disconnected")
        collect.result()
        return choices

    async def _collect(self, sink: asyncio.Queue, choices: list[Choice]) -> None:
        pending = len(choices)
        while pending:
            index, delta = await sink.get()
            if delta.error is not None:
                raise APIError(500, delta.error)
            choices[index].add(delta)
            pending -= delta.finished

    def _stream(self, request, jobs, kind: str, rid: str, created: int, body, chunk: Callable) -> EventSourceResponse:
        async def events() -> AsyncIterator[str]:
            sink: asyncio.Queue = asyncio.Queue()
            try:
                ids = await self._submit_all(jobs, sink)
            except APIError as err:
                yield json.dumps(error_body(err.message, err.status, param=err.param))
                yield "[DONE]"
                return
            choices = [Choice() for _ in jobs]
            started = [False] * len(jobs)
            pending = len(jobs)
            try:
                while pending:
                    index, delta = await sink.get()
                    if delta.error is not None:
                        yield json.dumps(error_body(delta.error, 500))
                        break
                    choices[index].add(delta)
                    pending -= delta.finished
                    if not (delta.text or delta.token_ids or delta.finished or not started[index]):
                        continue
                    part = chunk(index, choices[index], delta, not started[index])
                    started[index] = True
                    yield json.dumps({"id": rid, "object": kind, "created": created,
                                      "model": self.args.model_name, "choices": [part]})
                if not pending and body.include_usage:
                    final = {"id": rid, "object": kind, "created": created, "model": self.args.model_name,
                             "choices": [], "usage": usage(choices, [len(p) for p, _ in jobs])}
                    yield json.dumps(self._with_spec(final, choices, body))
                yield "[DONE]"
            finally:
                if pending:
                    self._abort(ids)  # the client went away (or the engine failed): drop what still runs

        return EventSourceResponse(events(), ping=0, shutdown_grace_period=STREAM_GRACE_SECONDS)

    def _abort(self, ids: Sequence[int]) -> None:
        for request_id in ids:
            self.engine.abort(request_id)

    def _with_spec(self, result: dict[str, Any], choices: Sequence[Choice], body) -> dict[str, Any]:
        mode = self.args.per_request_spec_decode_metrics
        k = self.server.num_speculative_tokens
        if k and (mode or body.spec_decode_metrics):
            result["metrics"] = spec_metrics(choices, k, detailed=mode == "detailed")
        return result

    # ----- inputs -----
    def _check_model(self, name: str | None) -> None:
        if name is None or name in (self.args.model_name, self.args.model):
            return
        # The checkpoint's folder however it is spelled (a client given an absolute path, the server a
        # relative one) is the same model.
        if not (os.path.isdir(name) and os.path.samefile(name, self.args.model)):
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.args.model_name}`",
                           "model")

    def _require_tokenizer(self, param: str | None):
        if self.tokenizer is None:
            raise APIError(400, "the model folder has no tokenizer; send token ids", param)
        return self.tokenizer

    def _encode(self, text: str, param: str, *, add_special_tokens: bool = True) -> list[int]:
        tok = self._require_tokenizer(param)
        return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self._encode(prompt, "prompt")
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(400, "prompt is empty", "prompt")
        return ids

    def _chat_prompt(self, messages, add_generation_prompt: bool) -> list[int]:
        tok = self._require_tokenizer("messages")
        if not tok.chat_template:
            raise APIError(400, "the model's tokenizer has no chat template; use /v1/completions", "messages")
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def _check_length(self, prompt_len: int, max_tokens: int, param: str) -> None:
        limit = self.server.max_model_len
        if prompt_len + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the request needs "
                                f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate): "
                                f"shorten the prompt or lower {param}", param)

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""


def _finish(choice: Choice, echo_only: bool) -> str | None:
    return "length" if echo_only else choice.finish_reason


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
