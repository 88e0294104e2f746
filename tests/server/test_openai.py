"""The server through real clients (the ``openai`` SDK and httpx): completions and chat, streaming and
not, give what in-process ``LLM.generate`` gives, token for token, with and without speculation."""

from __future__ import annotations

import httpx
import openai
import pytest

from live_server import MEMORY, LiveServer
from specdec import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(llama):
    llm = LLM(llama, dtype="float64", kv_cache_memory=64 << 20)
    return llm, llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("which", ["plain_server", "spec_server"])
def test_completions_equal_llm_generate(which, request, reference):
    server = request.getfixturevalue(which)
    client, (_, expected) = _client(server), reference
    model = server.server.args.model_name
    got = client.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [o.text for o in expected]
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in expected)
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    # Streaming: the pieces add up to the same text, the last chunk carries the finish reason.
    for prompt, want in zip(PROMPTS, expected):
        pieces, reasons = [], []
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True):
            pieces += [c.text for c in chunk.choices]
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        assert "".join(pieces) == want.text and reasons == [want.finish_reason]
    # Token-id prompts are the same requests.
    ids = client.completions.create(model=model, prompt=expected[0].prompt_token_ids, max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert ids.choices[0].text == expected[0].text


def test_speculation_reports_its_figures(spec_server, plain_server):
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "spec_decode_metrics": True}
    spec = httpx.post(f"{spec_server.base}/v1/completions", json=body).json()["metrics"]["speculative_decoding"]
    assert spec["num_spec_tokens"] == 3 and spec["num_spec_steps"] > 0
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"])
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_draft_tokens"]
    assert "metrics" not in httpx.post(f"{plain_server.base}/v1/completions", json=body).json()
    # A zoo pair fits: nothing warned at load, no acceptance alarm (the counter is there, at zero).
    assert spec_server.metrics()["specdec:spec_decode_warnings_total"] == 0


@pytest.mark.parametrize("which", ["plain_server", "spec_server"])
def test_chat_equals_llm_generate_on_the_templated_prompt(which, request, reference):
    server = request.getfixturevalue(which)
    llm, _ = reference
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    ids = llm.tokenizer(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)["input_ids"]
    want = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    client = _client(server)
    got = client.chat.completions.create(model=server.server.args.model_name, messages=messages,
                                         max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(ids)
    streamed = client.chat.completions.create(model=server.server.args.model_name, messages=messages,
                                              max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_stop_strings_logprobs_echo_and_n(spec_server, reference):
    llm, _ = reference
    base, prompt = spec_server.base, PROMPTS[0]
    want = llm.generate([prompt], SamplingParams(max_tokens=40, stop=[" of the list"], logprobs=2), use_tqdm=False)[0]
    got = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                                       "stop": " of the list", "logprobs": 2}).json()["choices"][0]
    assert got["text"] == want.text and got["finish_reason"] == "stop" == want.finish_reason
    lp = got["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-9)
    assert all(len(top) >= 2 for top in lp["top_logprobs"])
    # Streaming never sends a piece of the stop string.
    streamed = "".join(
        c.choices[0].text for c in _client(spec_server).completions.create(
            model=spec_server.server.args.model_name, prompt=prompt, max_tokens=40, temperature=0,
            stop=[" of the list"], stream=True))
    assert streamed == want.text
    # echo with max_tokens 0: the prompt and its logprobs only (what lm_eval's loglikelihood reads).
    echo = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                                        "logprobs": 1, "temperature": 0}).json()["choices"][0]
    ids = llm.tokenizer(prompt)["input_ids"]
    assert echo["text"] == llm.tokenizer.decode(ids) and echo["logprobs"]["token_logprobs"][0] is None
    assert len(echo["logprobs"]["token_logprobs"]) == len(ids)
    # n choices, seeded: reproducible, and different from each other.
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 7}
    first = httpx.post(f"{base}/v1/completions", json=body).json()["choices"]
    again = httpx.post(f"{base}/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in first] == [c["text"] for c in again] and len({c["text"] for c in first}) > 1


def test_models_tokenizer_routes_and_health(plain_server, reference):
    llm, _ = reference
    base = plain_server.base
    models = httpx.get(f"{base}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [plain_server.server.args.model_name]
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": "import os", "add_special_tokens": False}).json()
    assert tokens["tokens"] == llm.tokenizer("import os", add_special_tokens=False)["input_ids"]
    assert httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "import os"
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["chat_template"]
    assert httpx.get(f"{base}/health").status_code == 200


def test_shared_prompt_prefixes_hit_the_prefix_cache_and_metrics_say_so(llama):
    # A server stepping its engine in this process, so the engine's own figures can be read.
    prefix = PROMPTS[1] * 8  # about 100 tokens: several 16-token pages
    with LiveServer(llama, "--dtype", "float64", "--kv-cache-memory", MEMORY, in_thread=True) as server:
        for suffix in ("def add(a, b):\n", "class Queue:\n"):  # one after the other: the first one's pages are cached
            body = {"prompt": prefix + suffix, "max_tokens": 4, "temperature": 0}
            assert httpx.post(f"{server.base}/v1/completions", json=body).status_code == 200
        metrics = server.settled()
        engine = server.server.llm.prefix_cache_stats()
    queries, hits = metrics["vllm:prefix_cache_queries_total"], metrics["vllm:prefix_cache_hits_total"]
    assert (queries, hits) == (engine["queries"], engine["hits"])
    assert hits >= 64 and queries == metrics["vllm:prompt_tokens_total"]  # nothing was preempted and recomputed
