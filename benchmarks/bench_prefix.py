"""Prefix caching and speculation together: TTFT, output tok/s and hit rate, interleaved.

Four engines (prefix caching on / off x no speculation / a speculative config) run the same workload
in rounds, A B C D A B C D, each run on a freshly built engine so no run inherits another's cached
pages; medians over the rounds are printed, so the machine's drift hits every engine alike. The
workloads are ``specdec bench``'s: ``shared-prefix`` (requests over a few system prompts) and
``multi-turn`` (turn n + 1 extends turn n's prompt and output), both cut from held-out text (the
training corpus's validation split). Chunked prefill can be added with ``--max-num-batched-tokens``.

    python benchmarks/bench_prefix.py --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import statistics

from specdec import LLM, SamplingParams
from specdec.bench.config import BenchConfig
from specdec.bench.metrics import summarize
from specdec.bench.runner import serve
from specdec.bench.workload import load_workload

ZOO = "specdec/zoo/"


def run_once(config: BenchConfig, workload, spec, caching: bool) -> dict:
    llm = LLM(config.model, speculative_config=spec, dtype=config.dtype, kv_cache_memory=config.kv_cache_memory,
              max_num_seqs=config.concurrency, max_num_batched_tokens=config.max_num_batched_tokens,
              enable_prefix_caching=caching)
    params = SamplingParams(max_tokens=config.output_len, temperature=config.temperature[0], ignore_eos=True)
    serve(llm.engine, workload.warmup, params, config.concurrency)
    before = llm.engine.prefix_cache_stats()
    queries, hits = before.queries, before.hits
    records, _, duration, _ = serve(llm.engine, workload.prompts, params, config.concurrency,
                                    follow_up=workload.follow_up)
    result = summarize(records, duration)
    after = llm.engine.prefix_cache_stats()
    result["hit_rate"] = (after.hits - hits) / max(1, after.queries - queries)
    stats = llm.spec_stats()
    result["tau"] = stats.mean_acceptance_length if stats is not None else None
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=ZOO + "llama-tiny")
    parser.add_argument("--spec", default=f"eagle3:model={ZOO}llama-tiny-eagle3,num_speculative_tokens=3")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--workloads", default="shared-prefix,multi-turn")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    for name in args.workloads.split(","):
        config = BenchConfig(model=args.model, dtype=args.dtype, workload=name, kv_cache_memory=256 << 20,
                             num_prompts=args.num_prompts if name == "shared-prefix" else max(1, args.num_prompts // 3),
                             prefix_len=args.prefix_len, input_len=args.input_len, output_len=args.output_len,
                             concurrency=args.concurrency, max_num_batched_tokens=args.max_num_batched_tokens)
        workload = load_workload(config)
        engines = [(spec, caching) for caching in (False, True) for spec in (None, args.spec)]
        runs: dict = {e: [] for e in engines}
        for _ in range(args.rounds):
            for spec, caching in engines:
                runs[(spec, caching)].append(run_once(config, workload, spec, caching))
        print(f"\n{workload.description}; prompts: {workload.source}; {args.dtype}, concurrency {args.concurrency}, "
              f"{args.output_len} output tokens, medians of {args.rounds} interleaved rounds")
        print(f"{'engine':36s} {'out tok/s':>10s} {'TTFT med ms':>12s} {'TTFT mean ms':>13s} {'hit rate':>9s} {'tau':>5s}")
        for (spec, caching), results in runs.items():
            label = ("spec " if spec else "plain") + (", prefix caching" if caching else ", no caching")
            med = lambda key: statistics.median(r[key] for r in results)  # noqa: E731
            tau = results[0]["tau"]
            print(f"{label:36s} {med('output_throughput'):10.1f} {med('median_ttft_ms'):12.1f} "
                  f"{med('mean_ttft_ms'):13.1f} {results[0]['hit_rate']:9.3f} {tau if tau is None else round(tau, 2)!s:>5s}")


if __name__ == "__main__":
    main()
