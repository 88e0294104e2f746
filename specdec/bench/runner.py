"""Running the benchmark: the baseline and the speculative engine over the same prompts."""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any, Callable, Sequence

from specdec.bench.config import BenchConfig
from specdec.bench.metrics import RequestRecord, deltas, summarize
from specdec.bench.workload import load_prompts, text_config


def serve(
    engine, prompts: Sequence[Sequence[int]], params, concurrency: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[list[RequestRecord], float, float, list[list[int]]]:
    """Run ``prompts`` through ``engine`` with at most ``concurrency`` in flight.

    Returns the records (input order), the start time, the duration (first hand-over to last
    token) and the output token ids. Every request is validated before the clock starts (as
    ``LLMEngine.generate`` does), so a prompt that can never run fails before any work.
    """
    seqs = [engine.make_sequence(p, params, index=i) for i, p in enumerate(prompts)]
    records: list[RequestRecord | None] = [None] * len(seqs)
    pending = deque(range(len(seqs)))
    in_flight = 0
    start = clock()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i = pending.popleft()
            records[i] = RequestRecord(len(prompts[i]), clock())
            engine.add_sequence(seqs[i])
            in_flight += 1
        out = engine.step()
        now = clock()
        for r in out.requests:
            if r.new_token_ids:
                records[r.index].emissions.append((now, len(r.new_token_ids)))
            in_flight -= r.finished
    duration = clock() - start
    return records, start, duration, [seq.output_token_ids for seq in seqs]  # type: ignore[return-value]


def _max_model_len(config: BenchConfig, prompts: list[list[int]]) -> int:
    if config.max_model_len is not None:
        return config.max_model_len
    needed = max(len(p) for p in prompts) + config.output_len
    limit = getattr(text_config(config.model), "max_position_embeddings", None)
    if limit and needed > limit:
        raise ValueError(
            f"the longest prompt ({needed - config.output_len} tokens) + --output-len {config.output_len} exceeds "
            f"the model's max_position_embeddings ({limit}); shorten the prompts or lower --output-len"
        )
    return needed


def _run(config: BenchConfig, spec, prompts, max_model_len: int, progress) -> dict[str, Any]:
    from specdec.llm import LLM
    from specdec.sampling.params import SamplingParams

    llm = LLM.from_engine_args(config.engine_args(spec, max_model_len))
    params = SamplingParams(max_tokens=config.output_len, temperature=config.temperature, ignore_eos=True)
    engine = llm.engine
    if config.warmup:
        progress(f"warm-up: {config.warmup} request(s)")
        warm = [prompts[i % len(prompts)] for i in range(config.warmup)]
        serve(engine, warm, params, config.concurrency)
        llm.reset_spec_stats()
    progress(f"{len(prompts)} requests at concurrency {config.concurrency}")
    preempted = engine.stats.num_preemptions
    records, start, duration, outputs = serve(engine, prompts, params, config.concurrency)
    result = summarize(records, duration)
    # Recomputed requests slow a run down; a figure worth seeing next to the timings.
    result["num_preemptions"] = engine.stats.num_preemptions - preempted
    stats = llm.spec_stats()
    result["spec_stats"] = stats.as_dict() if stats is not None else None
    result["requests"] = [r.as_dict(start) for r in records]
    result["_outputs"] = outputs
    del llm, engine
    gc.collect()  # the next run's model and cache should not sit next to this one's
    return result


def run_benchmark(config: BenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the baseline (and the spec run when ``config.speculative_config`` is set); one JSON-ready dict.

    Keys: ``settings``; ``baseline`` and ``speculative`` (None without a config): the metrics of
    :func:`summarize` plus ``num_preemptions``, ``spec_stats`` and ``requests`` (per request:
    ``arrival_s``, ``prompt_len``, ``output_len``, ``ttft_ms``, ``e2el_ms``, ``tpot_ms``, ``itl_ms``,
    ``tokens_per_emission``);
    ``deltas`` (see :func:`deltas`); ``identical_outputs``: how many requests produced the same
    tokens in both runs (all of them, greedy in float64; lower precisions may differ by rounding).
    """
    say = progress or (lambda _msg: None)
    spec = config.speculative_config  # parsed when the config was built: a bad one fails before any run
    if config.base_url is not None and spec is not None:
        raise ValueError("--speculative-config is the server's over HTTP: start it with one, or compare two "
                         "servers with --baseline-url")
    prompts = load_prompts(config)
    max_model_len = _max_model_len(config, prompts)
    settings = {
        "model": config.model,
        "speculative_config": spec.to_dict() if spec is not None else None,
        "attention_backend": config.attention_backend,
        "dtype": config.dtype,
        "block_size": config.block_size,
        "dataset": config.dataset,
        "num_prompts": len(prompts),
        "mean_input_len": sum(map(len, prompts)) / len(prompts),
        "output_len": config.output_len,
        "concurrency": config.concurrency,
        "warmup": config.warmup,
        "temperature": config.temperature,
        "seed": config.seed,
        "max_model_len": max_model_len,
    }
    if config.base_url is not None:
        baseline, speculative = _runs_over_http(config, prompts, settings, say)
    else:
        say("baseline (no speculation)")
        baseline = _run(config, None, prompts, max_model_len, say)
        speculative = None
        if spec is not None:
            say(f"speculative ({spec.method}, k={spec.num_speculative_tokens})")
            speculative = _run(config, spec, prompts, max_model_len, say)
    outputs = [run.pop("_outputs") if run is not None else None for run in (baseline, speculative)]
    identical = None
    if baseline is not None and speculative is not None:
        identical = sum(a == b for a, b in zip(*outputs))
    return {
        "settings": settings,
        "baseline": baseline,
        "speculative": speculative,
        "deltas": deltas(baseline, speculative) if baseline is not None and speculative is not None else None,
        "identical_outputs": identical,
    }


def _runs_over_http(config: BenchConfig, prompts, settings: dict[str, Any], say):
    """The run against ``base_url`` (and the baseline against ``baseline_url``), as (baseline, speculative):
    a server without speculation is a baseline."""
    from specdec.bench.http import run_over_http

    common = dict(output_len=config.output_len, temperature=config.temperature, concurrency=config.concurrency,
                  warmup=config.warmup, seed=config.seed, progress=say)
    runs = [run_over_http(url, prompts, **common) for url in (config.baseline_url, config.base_url) if url]
    for run in runs:
        spec = run.pop("speculative_config")
        if spec is not None:
            settings["speculative_config"] = spec
    settings.update(base_url=config.base_url, baseline_url=config.baseline_url, attention_backend="(server's)",
                    dtype="(server's)")
    if len(runs) == 2:
        return runs[0], runs[1]
    return (runs[0], None) if settings["speculative_config"] is None else (None, runs[0])
