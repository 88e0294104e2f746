"""Under load: 128 concurrent clients, streaming and not, some hanging up mid-stream, some sending
malformed bodies. Every well-formed request that was not cancelled gets its complete, correct output;
afterwards the server is healthy with nothing running or waiting and its KV cache empty, and the
speculative counters in ``/metrics`` equal the sums of the per-request figures."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from live_server import MEMORY, LiveServer, eagle3_spec

from specdec import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n",
           "    for i in range(len(items)):\n", "    with open(filename, 'r') as f:\n", "def parse(text):\n",
           "# Copyright", "if __name__ == '__main__':\n"]
MAX_TOKENS = 24
CLIENTS = 128


@pytest.fixture(scope="module")
def expected(llama):
    llm = LLM(llama, dtype="float64", kv_cache_memory=64 << 20)
    return [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)]


async def _client(i: int, http: httpx.AsyncClient, url: str, rng: random.Random) -> tuple[str, int, object]:
    kind = rng.choice(["plain", "stream", "stream", "hangup", "malformed"])
    prompt = i % len(PROMPTS)
    body = {"prompt": PROMPTS[prompt], "max_tokens": MAX_TOKENS, "temperature": 0, "spec_decode_metrics": True}
    if kind == "malformed":
        bad = rng.choice([b'{"prompt": "x", "max_tokens": ', json.dumps({"prompt": "x", "top_p": 7}).encode(),
                          json.dumps({"max_tokens": 3}).encode()])
        response = await http.post(url, content=bad, headers={"content-type": "application/json"})
        return kind, prompt, response.status_code
    if kind == "plain":
        response = await http.post(url, json=body)
        return kind, prompt, response.json()
    async with http.stream("POST", url, json={**body, "stream": True}) as response:
        pieces = []
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            pieces.append(json.loads(line[len("data: "):]))
            if kind == "hangup" and len(pieces) == 2:
                return kind, prompt, None  # leaving the block closes the connection mid-stream
    return kind, prompt, pieces


@pytest.fixture(scope="module", params=["engine process", "engine thread"])
def spec_server(request, llama):
    """The EAGLE3 server both ways the engine runs: in its own process (``specdec serve``'s default) and in
    a thread, where the test also looks inside the engine."""
    with LiveServer(llama, "--dtype", "float64", "--kv-cache-memory", MEMORY, "--speculative-config",
                    eagle3_spec(), in_thread=request.param == "engine thread") as server:
        yield server


def test_128_concurrent_clients(spec_server, expected):
    url = f"{spec_server.base}/v1/completions"

    async def run():
        rng = random.Random(0)
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*[_client(i, http, url, rng) for i in range(CLIENTS)])

    results = asyncio.run(run())
    kinds = [k for k, _, _ in results]
    assert {"plain", "stream", "hangup", "malformed"} <= set(kinds)
    for kind, prompt, got in results:
        if kind == "malformed":
            assert got == 400
        elif kind == "plain":
            assert got["choices"][0]["text"] == expected[prompt] and got["choices"][0]["finish_reason"] == "length"
        elif kind == "stream":
            assert "".join(c["choices"][0]["text"] for c in got if c["choices"]) == expected[prompt]
            assert got[-1]["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{spec_server.base}/health").status_code == 200
    before = spec_server.settled()
    if spec_server.server.llm is not None:  # an engine thread: nothing of the proposer's is left either
        assert spec_server.server.llm.engine.proposer._states == {}
    # A clean round (no hang-ups): the counters move by exactly the responses' own figures.

    async def clean():
        async with httpx.AsyncClient(timeout=300) as http:
            body = {"max_tokens": MAX_TOKENS, "temperature": 0, "spec_decode_metrics": True}
            return await asyncio.gather(*[http.post(url, json={**body, "prompt": p}) for p in PROMPTS * 4])

    figures = [r.json()["metrics"]["speculative_decoding"] for r in asyncio.run(clean())]
    after = spec_server.settled()

    def moved(name):
        return after[name] - before[name]

    assert moved("vllm:spec_decode_num_drafts_total") == sum(f["num_spec_steps"] for f in figures) > 0
    assert moved("vllm:spec_decode_num_draft_tokens_total") == sum(f["num_draft_tokens"] for f in figures)
    assert moved("vllm:spec_decode_num_accepted_tokens_total") == sum(f["num_accepted_draft_tokens"] for f in figures)
    for pos in range(3):
        key = f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}}'
        assert moved(key) == sum(f["accepted_per_position"][pos] for f in figures)
