"""fp8 KV pages against the model's dtype (bf16) on the zoo Kimi-K2 and MiniMax-M3 pairs (issue 22).

    python benchmarks/bench_fp8_kv.py [--pairs kimi,minimax] [--kv-cache-memory 64M] [--concurrency 16]
        [--rounds 3] [--output-len 48] [--threads 1]

Per pair and KV dtype: the tokens a fixed ``--kv-cache-memory`` holds (target pool and draft pool), output
tok/s at ``--concurrency`` with EAGLE3 (k=3) and without speculation, and EAGLE3's acceptance per
position. Prompts: windows of the training corpus's validation documents (held out from the zoo drafts'
training), as benchmarks/bench_adaptive.py takes them. Engines are built once; each round runs every
configuration in an order that flips between rounds; tok/s ratios are taken within a round, then the
median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_adaptive import held_out_prompts, throughput  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.engine_args import byte_size  # noqa: E402
from specdec.zoo import zoo_path  # noqa: E402

PAIRS = {"kimi": ("kimi-k2-tiny", "kimi-k2-tiny-eagle3"), "minimax": ("minimax-m3-tiny", "minimax-m3-tiny-eagle3")}
KV_DTYPES = ("auto", "fp8")


def capacity(llm: LLM) -> dict[str, int]:
    """Tokens each pool holds."""
    return {name: pool.num_blocks * pool.block_size for name, pool in llm.engine.cache.pools.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="kimi,minimax")
    parser.add_argument("--kv-cache-memory", type=byte_size, default=byte_size("64M"))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=1)

    for pair in args.pairs.split(","):
        target, draft = (str(zoo_path(name)) for name in PAIRS[pair])
        spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 3}
        common = dict(dtype="bfloat16", kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.concurrency, seed=0)
        llms = {(kv, s): LLM(target, kv_cache_dtype=kv, speculative_config=spec if s else None, **common)
                for kv in KV_DTYPES for s in (False, True)}
        prompts = held_out_prompts(llms["auto", False], args.concurrency, args.input_len)
        rates = {key: [] for key in llms}
        for llm in llms.values():
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
            llm.reset_spec_stats()
        for r in range(args.rounds):
            for key in list(llms) if r % 2 == 0 else list(reversed(llms)):
                rates[key].append(throughput(llms[key], prompts, args.concurrency, params)[0])
        print(f"\n{pair}: {PAIRS[pair][0]} + eagle3 {PAIRS[pair][1]}, bf16 weights, {args.kv_cache_memory >> 20} MiB of "
              f"KV, c={args.concurrency}, {args.output_len} new tokens, held-out prompts, {args.rounds} interleaved rounds")
        for kv in KV_DTYPES:
            held = capacity(llms[kv, True])
            stats = llms[kv, True].spec_stats()
            for s in (False, True):
                ratio = statistics.median(a / b for a, b in zip(rates[kv, s], rates["auto", s]))
                print(f"  kv {kv:5s} {'eagle3 k=3' if s else 'no spec   '}  {statistics.median(rates[kv, s]):7.1f} tok/s  "
                      f"x{ratio:.2f} of bf16 KV")
            print(f"  kv {kv:5s} tokens held: {held}  acceptance per position "
                  f"{[round(a, 3) for a in stats.acceptance_per_position]}  tau {stats.mean_acceptance_length:.2f}")


if __name__ == "__main__":
    main()
