"""What the batch-invariant mode costs (issue 21): output tok/s with and without ``batch_invariant``, for
plain decoding and EAGLE3, at concurrency 1 and 16.

    python benchmarks/bench_batch_invariant.py [--target specdec/zoo/minimax-m3-tiny]
        [--draft specdec/zoo/minimax-m3-tiny-eagle3] [--k 3] [--concurrency 1,16] [--rounds 3]
        [--input-len 96] [--output-len 64] [--dtype bfloat16] [--threads 1]

Prompts: windows of the training corpus's validation documents (``specdec.train.corpus``, which no zoo
model trained on), as ``bench_adaptive.py`` takes them. The four engines (plain and EAGLE3, each with
the mode off and on) are built once; a round runs all four at every concurrency, in an order that
alternates between rounds (A B A B), so the machine's drift falls on all alike. Concurrency c runs
batches of c prompts with equal output lengths (``ignore_eos``). Reported: median output tok/s, the
mode's cost as the median within-round ratio, and how many greedy outputs equal plain decoding's
(with the mode: all of them).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench_adaptive import held_out_prompts, throughput
from specdec import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="specdec/zoo/minimax-m3-tiny")
    parser.add_argument("--draft", default="specdec/zoo/minimax-m3-tiny-eagle3")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--batches", type=int, default=2, help="batches of c prompts per concurrency c")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]

    spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.k}
    configs = {(name, mode): config for name, config in (("plain", None), (f"eagle3 k={args.k}", spec))
               for mode in (False, True)}
    common = dict(dtype=args.dtype, max_num_seqs=max(levels), kv_cache_memory=512 << 20, seed=0)
    llms = {key: LLM(args.target, speculative_config=config, batch_invariant=key[1], **common)
            for key, config in configs.items()}
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    prompts = held_out_prompts(llms["plain", False], max(levels) * args.batches, args.input_len)
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:2], params, use_tqdm=False)

    rates = {(key, c): [] for key in configs for c in levels}
    outputs = {}  # first round's tokens per (configuration, concurrency)
    for r in range(args.rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for c in levels:
            for key in order:
                rate, tokens = throughput(llms[key], prompts[: c * args.batches], c, params)
                rates[key, c].append(rate)
                outputs.setdefault((key, c), tokens)
            print(f"round {r + 1} c={c}: " + "  ".join(f"{n}{' [mode]' if m else ''} {rates[(n, m), c][-1]:.0f}"
                                                         for n, m in configs), flush=True)

    print(f"\n{args.target} + eagle3 {args.draft}, {args.dtype}, {args.threads} thread(s), greedy, "
          f"{args.output_len} new tokens, held-out prompts of {args.input_len} tokens, {args.rounds} interleaved rounds")
    for c in levels:
        print(f"\nconcurrency {c}")
        for name in dict.fromkeys(n for n, _ in configs):
            off, on = rates[(name, False), c], rates[(name, True), c]
            cost = statistics.median(b / a for a, b in zip(off, on))
            print(f"  {name:12s} off {statistics.median(off):8.1f} tok/s   on {statistics.median(on):8.1f} tok/s   "
                  f"mode x{cost:.2f}")
        for mode in (False, True):
            plain, spec_out = outputs[("plain", mode), c], outputs[(f"eagle3 k={args.k}", mode), c]
            same = sum(a == b for a, b in zip(plain, spec_out))
            print(f"  mode {'on ' if mode else 'off'}: eagle3 outputs identical to plain {same}/{len(plain)}")


if __name__ == "__main__":
    main()
