"""Running the benchmark: the baseline and the speculative engine over the same prompts."""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any, Callable, Sequence

from specdec.bench.config import BenchConfig
from specdec.bench.metrics import RequestRecord, deltas, prefix_cache_figures, summarize
from specdec.bench.workload import Workload, load_workload, text_config


FollowUp = Callable[[int, int, Sequence[int], Sequence[int]], list[int] | None]


def serve(
    engine, prompts: Sequence[Sequence[int]], params, concurrency: int, clock: Callable[[], float] = time.perf_counter,
    follow_up: FollowUp | None = None,
) -> tuple[list[RequestRecord], float, float, list[list[int]]]:
    """Run ``prompts`` through ``engine`` with at most ``concurrency`` in flight.

    With ``follow_up`` each prompt opens a conversation: when its turn ``t`` (from 0) finishes,
    ``follow_up(conversation, t, prompt, output)`` gives the conversation's next prompt (None: it is
    over), which goes in before any new conversation, so a conversation keeps its place.

    ``params``: one ``SamplingParams`` for every request, or one per prompt (a conversation's turns
    share its prompt's).

    Returns the records, the start time, the duration (first hand-over to last token) and the output
    token ids, request by request in input order (conversation by conversation, turn by turn). Every
    first request is validated before the clock starts (as ``LLMEngine.generate`` does), so a prompt
    that can never run fails before any work.
    """
    per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    seqs = [engine.make_sequence(p, sp, index=i) for i, (p, sp) in enumerate(zip(prompts, per_prompt))]
    done: list[list[tuple[RequestRecord, Any]]] = [[] for _ in seqs]  # per conversation: (record, sequence)
    pending = deque((c, seq, prompt) for c, (seq, prompt) in enumerate(zip(seqs, prompts)))
    in_flight: dict[int, tuple[int, Sequence[int]]] = {}  # index -> (conversation, prompt)
    next_index = len(seqs)
    start = clock()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            c, seq, prompt = pending.popleft()
            done[c].append((RequestRecord(len(prompt), clock()), seq))
            engine.add_sequence(seq)
            in_flight[seq.index] = (c, prompt)
        out = engine.step()
        now = clock()
        turns = []
        for r in out.requests:
            c, prompt = in_flight[r.index]
            record, seq = done[c][-1]
            if r.new_token_ids:
                record.emissions.append((now, len(r.new_token_ids)))
            if not r.finished:
                continue
            del in_flight[r.index]
            nxt = follow_up(c, len(done[c]) - 1, prompt, seq.output_token_ids) if follow_up is not None else None
            if nxt is not None:
                turns.append((c, engine.make_sequence(nxt, per_prompt[c], index=next_index), nxt))
                next_index += 1
        pending.extendleft(reversed(turns))
    duration = clock() - start
    requests = [request for conversation in done for request in conversation]
    return [r for r, _ in requests], start, duration, [seq.output_token_ids for _, seq in requests]


def _max_model_len(config: BenchConfig, workload: Workload) -> int:
    if config.max_model_len is not None:
        return config.max_model_len
    longest = max(workload.prompt_lengths())
    needed = longest + max(workload.output_lens)
    limit = getattr(text_config(config.model), "max_position_embeddings", None)
    if limit and needed > limit:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + the longest output ({max(workload.output_lens)} tokens, "
            f"--output-len and --output-spread) exceeds the model's max_position_embeddings ({limit}); "
            "shorten the prompts or lower --output-len"
        )
    return needed


def _run(config: BenchConfig, spec, workload: Workload, max_model_len: int, temperature: float,
         progress) -> dict[str, Any]:
    from specdec.llm import LLM

    llm = LLM.from_engine_args(config.engine_args(spec, max_model_len))
    try:
        return _measure(llm, config, workload, temperature, progress)
    finally:
        llm.close()  # its tensor-parallel workers stop before the next run starts its own
        del llm
        gc.collect()  # the next run's model and cache should not sit next to this one's


def _measure(llm, config: BenchConfig, workload: Workload, temperature: float, progress) -> dict[str, Any]:
    from specdec.sampling.params import SamplingParams

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)

    engine = llm.engine
    if workload.warmup:
        progress(f"warm-up: {len(workload.warmup)} request(s)")
        serve(engine, workload.warmup, params(config.output_len), config.concurrency)
        llm.reset_spec_stats()
    progress(f"{workload.description} at concurrency {config.concurrency}")
    preempted = engine.stats.num_preemptions
    cache = engine.prefix_cache_stats()
    queries, hits = cache.queries, cache.hits
    records, start, duration, outputs = serve(engine, workload.prompts, [params(n) for n in workload.output_lens],
                                              config.concurrency, follow_up=workload.follow_up)
    result = summarize(records, duration)
    # Recomputed requests slow a run down; a figure worth seeing next to the timings.
    result["num_preemptions"] = engine.stats.num_preemptions - preempted
    cache = engine.prefix_cache_stats()
    result["prefix_cache"] = prefix_cache_figures(cache.queries - queries, cache.hits - hits)
    stats = llm.spec_stats()
    result["spec_stats"] = stats.as_dict() if stats is not None else None
    result["requests"] = [r.as_dict(start) for r in records]
    result["_outputs"] = outputs
    return result


def run_benchmark(config: BenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the baseline (and the spec run when ``config.speculative_config`` is set) at each of
    ``config.temperature``, each run on a fresh engine; one JSON-ready dict.

    Keys: ``settings`` (``prompt_source`` names where the prompts come from; ``temperature`` lists
    the temperatures); ``runs``: one entry per temperature, in the order given, each
    ``{"temperature", "baseline", "speculative", "deltas", "identical_outputs"}``; and the first
    temperature's ``baseline``, ``speculative``, ``deltas`` and ``identical_outputs`` again at the top
    level (what a single temperature gives). ``baseline`` and ``speculative`` (None without a
    config): the metrics of :func:`summarize` plus ``num_preemptions``, ``prefix_cache`` (the run's
    prefix-cache ``queries`` and ``hits`` in tokens, and ``hit_rate``), ``spec_stats`` (with
    ``num_drafts_histogram``: how many drafts each (request, step) was given) and ``requests`` (per
    request, in run order (multi-turn: conversation by conversation): ``arrival_s``, ``prompt_len``,
    ``output_len``, ``ttft_ms``, ``e2el_ms``, ``tpot_ms``, ``itl_ms``, ``tokens_per_emission``);
    ``deltas`` (see :func:`deltas`); ``identical_outputs``: how many requests produced the same
    tokens in both runs (greedy, and sampled with deterministic drafts, which the coupled verifier
    checks: all of them in float64, lower precisions may differ by rounding; sampled with drafts drawn
    from q, rejection sampling keeps the target's law but draws differently, so they need not match).
    """
    say = progress or (lambda _msg: None)
    spec = config.speculative_config  # parsed when the config was built: a bad one fails before any run
    if config.base_url is not None and spec is not None:
        raise ValueError("--speculative-config is the server's over HTTP: start it with one, or compare two "
                         "servers with --baseline-url")
    workload = load_workload(config)
    max_model_len = _max_model_len(config, workload)
    lengths = workload.prompt_lengths()
    settings = {
        "model": config.model,
        "speculative_config": spec.to_dict() if spec is not None else None,
        "attention_backend": config.attention_backend,
        "dtype": config.dtype,
        "block_size": config.block_size,
        "enable_prefix_caching": config.enable_prefix_caching,
        "tensor_parallel_size": config.tensor_parallel_size,
        "batch_invariant": config.batch_invariant,
        "workload": workload.name,
        "workload_description": workload.description,
        "prompt_source": workload.source,
        "dataset": config.dataset,
        "num_prompts": len(lengths),
        "num_conversations": len(workload.prompts),
        "mean_input_len": sum(lengths) / len(lengths),
        "output_len": config.output_len,
        "output_spread": config.output_spread,
        "concurrency": config.concurrency,
        "warmup": config.warmup,
        "temperature": list(config.temperature),
        "seed": config.seed,
        "max_model_len": max_model_len,
    }
    runs = []
    for temperature in config.temperature:
        if config.base_url is not None:
            baseline, speculative = _runs_over_http(config, workload, temperature, settings, say)
        else:
            say(f"baseline (no speculation), temperature {temperature:g}")
            baseline = _run(config, None, workload, max_model_len, temperature, say)
            speculative = None
            if spec is not None:
                say(f"speculative ({spec.method}, k={spec.num_speculative_tokens}), temperature {temperature:g}")
                speculative = _run(config, spec, workload, max_model_len, temperature, say)
        runs.append({"temperature": temperature, **_compare(baseline, speculative)})
    return {"settings": settings, **{k: v for k, v in runs[0].items() if k != "temperature"}, "runs": runs}


def _compare(baseline: dict[str, Any] | None, speculative: dict[str, Any] | None) -> dict[str, Any]:
    """One temperature's runs, their deltas and how many requests' outputs matched."""
    outputs = [run.pop("_outputs") if run is not None else None for run in (baseline, speculative)]
    both = baseline is not None and speculative is not None
    return {
        "baseline": baseline,
        "speculative": speculative,
        "deltas": deltas(baseline, speculative) if both else None,
        "identical_outputs": sum(a == b for a, b in zip(*outputs)) if both else None,
    }


def _runs_over_http(config: BenchConfig, workload: Workload, temperature: float, settings: dict[str, Any], say):
    """The run against ``base_url`` (and the baseline against ``baseline_url``) at ``temperature``, as
    (baseline, speculative): a server without speculation is a baseline. The engine options are the
    servers' (and so are their prefix caches: a later temperature's prompts may find pages an earlier
    one left)."""
    from specdec.bench.http import run_over_http

    common = dict(output_len=config.output_len, temperature=temperature, concurrency=config.concurrency,
                  seed=config.seed, progress=say)
    runs = [run_over_http(url, workload, **common) for url in (config.baseline_url, config.base_url) if url]
    for run in runs:
        spec = run.pop("speculative_config")
        if spec is not None:
            settings["speculative_config"] = spec
    settings.update(base_url=config.base_url, baseline_url=config.baseline_url, attention_backend="(server's)",
                    dtype="(server's)", enable_prefix_caching="(server's)", tensor_parallel_size="(server's)",
                    batch_invariant="(server's)")
    if len(runs) == 2:
        return runs[0], runs[1]
    return (runs[0], None) if settings["speculative_config"] is None else (None, runs[0])
