"""Bad input and faults: OpenAI error objects with the right status and field, API keys, overload,
disconnecting clients (their pages and proposer state freed at once), a failing engine step, and a
SIGTERM that lets in-flight requests finish and exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from live_server import MEMORY, LiveServer, eagle3_spec, start_cli_server
from specdec.proposers import register_proposer
from specdec.proposers.ngram import NgramProposer
from specdec.zoo import zoo_path

LONG = {"prompt": "def fibonacci(n):\n", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def _error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param
    assert "\n" not in error["message"]
    return error["message"]


@pytest.mark.parametrize(
    "body, param, needle",
    [
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", "integer"),
        ({"prompt": "x", "top_p": 2}, "top_p", "less than or equal to 1"),
        ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"prompt": "x", "stop": [""]}, "stop", "non-empty"),
        ({"max_tokens": 3}, "prompt", "Field required"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
        ({"prompt": list(range(3, 9000))}, "max_tokens", "maximum context length is 8192"),
        ({"prompt": "x", "max_tokens": 9000}, "max_tokens", "maximum context length is 8192"),
    ],
)
def test_bad_completion_bodies_are_400_naming_the_field(plain_server, body, param, needle):
    assert needle in _error(httpx.post(f"{plain_server.base}/v1/completions", json=body), 400, param)


def test_malformed_json_unknown_model_and_bad_chat(plain_server):
    base = plain_server.base
    raw = httpx.post(f"{base}/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert "not valid JSON" in _error(raw, 400)
    assert "does not exist" in _error(httpx.post(f"{base}/v1/completions", json={"prompt": "x", "model": "gpt-4"}),
                                      404, "model")
    assert _error(httpx.post(f"{base}/v1/chat/completions", json={"messages": []}), 400, "messages")
    bad_role = {"messages": [{"role": "robot", "content": "hi"}]}
    assert _error(httpx.post(f"{base}/v1/chat/completions", json=bad_role), 400, "messages.0.role")


def test_api_key():
    with LiveServer(str(zoo_path("llama-tiny")), "--kv-cache-memory", MEMORY, "--api-key", "s3cret") as server:
        url = f"{server.base}/v1/completions"
        body = {"prompt": "x", "max_tokens": 2}
        _error(httpx.post(url, json=body), 401)
        _error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{server.base}/health").status_code == 200  # probes need no key


def test_past_the_request_limit_is_503_never_a_hang():
    with LiveServer(str(zoo_path("llama-tiny")), "--kv-cache-memory", MEMORY, "--max-waiting-requests", "2") as server:
        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                body = {**LONG, "max_tokens": 60}
                return await asyncio.gather(*[client.post(f"{server.base}/v1/completions", json=body) for _ in range(6)])

        statuses = sorted(r.status_code for r in asyncio.run(burst()))
        assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}
        assert httpx.get(f"{server.base}/health").status_code == 200



def test_a_client_that_disconnects_frees_its_pages_and_proposer_state(llama):
    with LiveServer(llama, "--kv-cache-memory", MEMORY, "--speculative-config", eagle3_spec(),
                    in_thread=True) as server:
        engine = server.server.llm.engine
        with httpx.stream("POST", f"{server.base}/v1/completions", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert engine.running_ids()  # it is running now; closing the stream aborts it
        server.settled()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.base}/v1/completions", json={**LONG, "max_tokens": 4000}, timeout=0.5)
        server.settled()
        assert engine.proposer._states == {} and engine.cache.requests() == []
        assert server.server.engine.in_flight == 0


def test_an_engine_process_that_dies_fails_its_requests_and_the_server_says_so(llama):
    with LiveServer(llama, "--kv-cache-memory", MEMORY) as server:
        url = f"{server.base}/v1/completions"
        with httpx.stream("POST", url, json={**LONG, "stream": True}) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            assert "choices" in json.loads(next(lines)[len("data: "):])
            os.kill(server.server.engine.transport.pid, signal.SIGKILL)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == 500 and "engine process exited" in error["message"]
        assert httpx.get(f"{server.base}/health").status_code == 503
        assert "engine process exited" in _error(httpx.post(url, json={**LONG, "max_tokens": 2}), 503)


class _Faulty(NgramProposer):
    """Fails the step whenever a request's prompt holds token 4000."""

    def propose(self, seqs, max_drafts):
        if any(4000 in seq.token_ids[: seq.num_prompt_tokens] for seq in seqs):
            raise RuntimeError("planted proposer fault")
        return super().propose(seqs, max_drafts)


def test_a_failing_step_fails_its_requests_with_500_and_the_server_goes_on():
    register_proposer("faulty-test", _Faulty)
    with LiveServer(str(zoo_path("llama-tiny")), "--kv-cache-memory", MEMORY,
                    "--speculative-config", "faulty-test:num_speculative_tokens=2,prompt_lookup_min=1",
                    in_thread=True) as server:  # a proposer registered in code is known in this process only
        url = f"{server.base}/v1/completions"
        ok = {"prompt": [1, 5, 6, 5, 6, 5], "max_tokens": 8, "temperature": 0}
        message = _error(httpx.post(url, json={**ok, "prompt": [1, 4000, 5, 4000, 5]}), 500)
        assert "planted proposer fault" in message
        assert httpx.post(url, json=ok).status_code == 200
        assert server.metrics()["specdec:engine_step_errors_total"] == 1
        server.settled()


@pytest.mark.parametrize("sig, stream", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_sigterm_or_ctrl_c_lets_in_flight_requests_finish_and_exits_0(sig, stream):
    proc, base = start_cli_server(str(zoo_path("llama-tiny")), "--kv-cache-memory", MEMORY)
    result = {}
    body = {**LONG, "max_tokens": 600, "stream": stream, "stream_options": {"include_usage": True}}

    def request():
        if not stream:
            result["tokens"] = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["usage"][
                "completion_tokens"]
            return
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        result["tokens"] = json.loads(lines[-2][len("data: "):])["usage"]["completion_tokens"]

    def timed():
        request()
        result["done_at"] = time.monotonic()

    client = threading.Thread(target=timed)
    client.start()
    time.sleep(1.0)  # the request is in flight
    proc.send_signal(sig)
    signalled_at = time.monotonic()
    client.join(timeout=120)
    assert proc.wait(timeout=60) == 0
    assert result["tokens"] == 600 and result["done_at"] > signalled_at  # it finished after the signal
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health", timeout=2)


def test_an_engine_that_cannot_start_is_one_error_line_from_the_engine_process(llama):
    spec = json.dumps({"method": "eagle3", "model": str(zoo_path("draft-model-tiny")), "num_speculative_tokens": 2})
    done = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", llama, "--speculative-config", spec],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: EAGLE3 draft")
    assert "is not an EAGLE3 draft" in done.stderr
