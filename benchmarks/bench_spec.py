"""Tokens/s with and without speculation, with the acceptance statistics, as one table.

    python benchmarks/bench_spec.py [--target DIR --draft DIR] [--k 3] [--batch 4] [--max-tokens 64]

Without folders a small random Llama target (hidden 512, 8 layers) and a smaller random draft
(hidden 128, 2 layers) with the same vocabulary are written to a temporary folder. Random
weights make the small draft's acceptance near zero; the "self" row (the target as its own
draft) shows the cost ceiling at acceptance 1.0, and n-gram feeds on the loops random models
fall into. Pass trained checkpoints (e.g. from ``python -m specdec.train``) for real figures.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench_decode import small_llama  # the script's folder is on sys.path


def run(target: str, spec, prompts, params, dtype: str) -> tuple[float, object, list]:
    from specdec import LLM

    llm = LLM(target, speculative_config=spec, dtype=dtype, kv_cache_memory=256 << 20)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    llm.reset_spec_stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return tokens / wall, llm.spec_stats(), [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target checkpoint folder (default: a random small llama)")
    parser.add_argument("--draft", help="draft checkpoint folder, same vocabulary (default: a random smaller llama)")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specdec import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        vocab = 4096
        target = args.target or small_llama(str(Path(tmp) / "target"), 512, 8, vocab, seed=0)
        draft = args.draft or small_llama(str(Path(tmp) / "draft"), 128, 2, vocab, seed=1)
        prompts = [[(13 * i + j % 9) % 1000 + 3 for j in range(48)] for i in range(args.batch)]
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        k = args.k
        rows = [
            ("none", None),
            (f"ngram k={k}", f"ngram:num_speculative_tokens={k},prompt_lookup_min=2,prompt_lookup_max=4"),
            (f"draft_model k={k}", {"method": "draft_model", "model": draft, "num_speculative_tokens": k}),
            (f"self draft k={k}", {"method": "draft_model", "model": target, "num_speculative_tokens": k}),
        ]
        print(f"target {target if args.target else 'random llama 512x8'}, draft "
              f"{draft if args.draft else 'random llama 128x2'}, batch {args.batch}, {args.max_tokens} tokens each, "
              f"{args.dtype}, greedy, {args.threads} thread(s)")
        header = f"{'speculation':<18} | {'tokens/s':>9} | {'speedup':>7} | {'tau':>5} | {'accept':>6} | per position"
        print(header)
        print("-" * len(header))
        base_tps, base_out = None, None
        for name, spec in rows:
            tps, stats, outputs = run(target, spec, prompts, params, args.dtype)
            if base_tps is None:
                base_tps, base_out = tps, outputs
            same = "" if outputs == base_out else "  (outputs differ: not float64)"
            if stats is None:
                print(f"{name:<18} | {tps:>9.1f} | {1.0:>6.2f}x | {'-':>5} | {'-':>6} | -")
            else:
                per = ", ".join(f"{a:.2f}" for a in stats.acceptance_per_position)
                print(f"{name:<18} | {tps:>9.1f} | {tps / base_tps:>6.2f}x | {stats.mean_acceptance_length:>5.2f} | "
                      f"{stats.draft_acceptance_rate:>6.1%} | {per}{same}")


if __name__ == "__main__":
    main()
