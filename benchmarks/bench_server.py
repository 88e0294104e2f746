"""The server against the in-process engine on one workload, with and without speculation.

    python benchmarks/bench_server.py [--concurrency 16] [--repeats 5]

Every engine runs ``--threads`` compute threads (default 1, leaving the second core to the HTTP client
that a served run needs and an in-process run does not). Starts two ``specdec serve`` processes on
127.0.0.1 (the zoo MiniMax-M3 target without and with its EAGLE3 draft, bf16; each steps its engine in
an engine process of its own) and builds the same two engines in this process. Then, repeat by repeat, it runs
the same requests through each in turn (in-process plain, HTTP plain, in-process spec, HTTP spec), so
all four meet the same machine load, and prints:

- output tok/s of each, and HTTP / in-process per pair (median over repeats): the server's overhead
  (its client runs on the same cores, as a benchmark client on the serving host would);
- the seed-001 table over HTTP (no speculation vs eagle3), from the last repeat.

Prompts are windows of the corpus's validation split, which no zoo model trained on (held-out text),
64 tokens each; every request generates ``--output-len`` tokens (``ignore_eos``), greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import httpx
import torch

from specdec import LLM, SamplingParams
from specdec.bench import deltas, format_table, serve, summarize
from specdec.bench.http import serve_over_http as serve_http
from specdec.bench.http import read_counters, spec_stats_between
from specdec.train.corpus import validation_prompts
from specdec.zoo import zoo_path


def start_server(port: int, threads: int, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", *argv, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server on port {port} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=96)  # six waves at 16: ramp-up and -down weigh little
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)  # the first is often an outlier
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads of every engine, in-process and served (default 1: the benchmark's "
                             "client needs the other core, as the peer harness does)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target, draft = str(zoo_path("minimax-m3-tiny")), str(zoo_path("minimax-m3-tiny-eagle3"))
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": args.k}
    common = ["--dtype", "bfloat16", "--block-size", "128", "--kv-cache-memory", "512M",
              "--max-num-seqs", str(args.concurrency), "--stats-interval", "3600"]

    servers = {"plain": (start_server(8601, args.threads, target, *common), "http://127.0.0.1:8601"),
               "spec": (start_server(8602, args.threads, target, *common, "--speculative-config", json.dumps(spec)),
                        "http://127.0.0.1:8602")}
    engines = {label: LLM(target, dtype="bfloat16", block_size=128, kv_cache_memory=512 << 20,
                          max_num_seqs=args.concurrency, speculative_config=spec if label == "spec" else None)
               for label in ("plain", "spec")}
    prompts = validation_prompts(target, args.num_prompts, 64)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    try:
        for label in ("plain", "spec"):  # warm-up, uncounted
            serve(engines[label].engine, prompts[:2], params, 2)
            asyncio.run(serve_http(servers[label][1], target, prompts[:2], [args.output_len] * 2, 0.0, 2, 0))
        tps = {key: [] for key in ("inproc plain", "http plain", "inproc spec", "http spec")}
        last = {}
        for _ in range(args.repeats):
            for label in ("plain", "spec"):
                records, _, duration, _ = serve(engines[label].engine, prompts, params, args.concurrency)
                tps[f"inproc {label}"].append(summarize(records, duration)["output_throughput"])
                base = servers[label][1]
                before = read_counters(base)
                records, _, duration, outputs = asyncio.run(
                    serve_http(base, target, prompts, [args.output_len] * len(prompts), 0.0, args.concurrency, 0))
                run = summarize(records, duration)
                run["num_preemptions"] = 0
                run["spec_stats"] = spec_stats_between(before, read_counters(base), args.k) if label == "spec" else None
                tps[f"http {label}"].append(run["output_throughput"])
                last[label] = (run, outputs)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)

    print(f"output tok/s, concurrency {args.concurrency}, {args.num_prompts} held-out prompts of 64 tokens, "
          f"{args.output_len} new tokens, {args.repeats} interleaved repeats")
    for key, values in tps.items():
        print(f"  {key:13s} " + " ".join(f"{v:7.1f}" for v in values))
    for label in ("plain", "spec"):
        ratios = [h / i for h, i in zip(tps[f"http {label}"], tps[f"inproc {label}"])]
        print(f"  HTTP / in-process, {label}: median {statistics.median(ratios):.3f} "
              f"(runs {', '.join(f'{r:.3f}' for r in ratios)})")
    (base_run, base_out), (spec_run, spec_out) = last["plain"], last["spec"]
    result = {
        "settings": {"model": target, "speculative_config": spec, "attention_backend": "torch", "dtype": "bfloat16",
                     "num_prompts": len(prompts), "dataset": "corpus validation split (held out)", "warmup": 2,
                     "mean_input_len": 64, "output_len": args.output_len, "concurrency": args.concurrency,
                     "base_url": servers["spec"][1]},
        "baseline": base_run, "speculative": spec_run, "deltas": deltas(base_run, spec_run),
        "identical_outputs": sum(a == b for a, b in zip(base_out, spec_out)),
    }
    print(format_table(result))


if __name__ == "__main__":
    main()
