"""``specdec bench --base-url``: the same workload against a running server, over HTTP.

An async httpx client streams ``/v1/completions`` (token-id prompts, ``ignore_eos``, vLLM's
``return_token_ids``) with at most ``concurrency`` requests in flight, as vLLM's
``benchmark_serving`` does: a request arrives when the concurrency limit lets it through, and each
streamed chunk is one emission (a speculative step's tokens come in one chunk). The acceptance figures
and prefix-cache figures are the server's ``/metrics`` counters after the run minus before it. A
multi-turn conversation sends its turns one after another, each once the previous one's output came back.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Sequence

import httpx

from specdec.bench.metrics import RequestRecord, prefix_cache_figures, summarize
from specdec.bench.workload import Workload

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def server_card(base_url: str) -> dict[str, Any]:
    """The served model's entry of ``/v1/models`` (its name and speculative config)."""
    try:
        response = httpx.get(f"{base_url}/v1/models", timeout=30)
        response.raise_for_status()
    except httpx.HTTPError as err:
        raise ValueError(f"no specdec server answers at {base_url} ({err}); start one with 'specdec serve'") from None
    return response.json()["data"][0]


def read_counters(base_url: str) -> dict[str, float]:
    """The server's counters, summed over labels other than ``position``."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        name, _, labels = key.partition("{")
        position = next((x for x in labels.rstrip("}").split(",") if x.startswith("position=")), None)
        if position is not None:
            name = f"{name}[{position.split('=')[1].strip(chr(34))}]"
        out[name] = out.get(name, 0.0) + float(value)
    return out


def spec_stats_between(before: dict[str, float], after: dict[str, float], k: int) -> dict[str, Any]:
    """``SpecStats.as_dict()``'s figures from two readings of the counters (``num_drafts_histogram``,
    ``num_drafts_by_verifier`` and ``warnings`` are None: the server's ``/metrics`` counts neither the drafts
    chosen per step nor which verifier checked them, and warnings only by number)."""
    drafts, drafted, accepted = (after.get(n, 0) - before.get(n, 0) for n in SPEC_COUNTERS)
    per_position = [int(after.get(f"{PER_POSITION}[{i}]", 0) - before.get(f"{PER_POSITION}[{i}]", 0)) for i in range(k)]
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(drafted),
        "num_accepted_tokens": int(accepted),
        "accepted_per_position": per_position,
        "acceptance_per_position": [a / drafts if drafts else 0.0 for a in per_position],
        "mean_acceptance_length": 1.0 + (accepted / drafts if drafts else 0.0),
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "num_drafts_histogram": None,
        "num_drafts_by_verifier": None,
        "warnings": None,
    }


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord) -> list[int]:
    tokens: list[int] = []
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise ValueError(f"the server answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise ValueError(f"the server failed a request: {chunk['error']['message']}")
            new = [t for c in chunk["choices"] for t in c.get("token_ids", ())]
            if new:
                record.emissions.append((time.perf_counter(), len(new)))
                tokens += new
    return tokens


async def serve_over_http(base_url: str, model: str, prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
                          temperature: float, concurrency: int, seed: int, follow_up=None):
    """``runner.serve``'s run over HTTP, with the same arguments and results: at most ``concurrency``
    conversations (single requests without ``follow_up``) in flight, each sending its turns one after
    another, each turn of conversation c asking for ``output_lens[c]`` tokens."""
    url = f"{base_url}/v1/completions"
    limit = asyncio.Semaphore(concurrency)
    records: list[list[RequestRecord]] = [[] for _ in prompts]
    outputs: list[list[list[int]]] = [[] for _ in prompts]

    async def conversation(c: int, client: httpx.AsyncClient) -> None:
        async with limit:
            prompt: Sequence[int] | None = prompts[c]
            while prompt is not None:
                turn = len(records[c])
                records[c].append(RequestRecord(len(prompt), time.perf_counter()))
                body = {"model": model, "prompt": list(prompt), "max_tokens": output_lens[c], "temperature": temperature,
                        "ignore_eos": True, "stream": True, "return_token_ids": True,
                        "seed": seed + c + turn * len(prompts)}
                outputs[c].append(await _one(client, url, body, records[c][-1]))
                prompt = follow_up(c, turn, prompt, outputs[c][-1]) if follow_up is not None else None

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*[conversation(c, client) for c in range(len(prompts))])
        duration = time.perf_counter() - start
    return [r for turns in records for r in turns], start, duration, [o for turns in outputs for o in turns]


def run_over_http(base_url: str, workload: Workload, *, output_len: int, temperature: float, concurrency: int,
                  seed: int, progress) -> dict[str, Any]:
    """One run of ``workload`` against the server at ``base_url``: ``summarize``'s metrics plus
    ``num_preemptions``, ``prefix_cache`` and ``spec_stats`` (from ``/metrics``, None without
    speculation), ``requests`` and ``speculative_config``. Each request asks for its conversation's
    ``workload.output_lens`` tokens (``output_len``: the warm-up requests'). A server keeps its prefix
    cache across runs: run a workload twice and the second finds the first's pages."""
    card = server_card(base_url)
    spec = card.get("speculative_config")
    if workload.warmup:
        progress(f"warm-up: {len(workload.warmup)} request(s) to {base_url}")
        asyncio.run(serve_over_http(base_url, card["id"], workload.warmup, [output_len] * len(workload.warmup),
                                    temperature, concurrency, seed))
    before = read_counters(base_url)
    progress(f"{workload.description} at concurrency {concurrency} to {base_url}")
    records, start, duration, outputs = asyncio.run(serve_over_http(
        base_url, card["id"], workload.prompts, workload.output_lens, temperature, concurrency, seed, workload.follow_up))
    after = read_counters(base_url)
    grew = {name: after.get(name, 0) - before.get(name, 0) for name in
            ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}
    result = summarize(records, duration)
    result["num_preemptions"] = int(grew["vllm:num_preemptions_total"])
    result["prefix_cache"] = prefix_cache_figures(grew["vllm:prefix_cache_queries_total"],
                                                  grew["vllm:prefix_cache_hits_total"])
    result["spec_stats"] = spec_stats_between(before, after, spec["num_speculative_tokens"]) if spec else None
    result["requests"] = [r.as_dict(start) for r in records]
    result["speculative_config"] = spec
    result["_outputs"] = outputs
    return result
