"""The schedules of ``FusedExperts`` (dense: every expert on every token, as the batched matmuls
training runs or as the two wide layers served weights run; routed: one matmul per expert over its
tokens) on the zoo MoEs' shapes, by batch size: where ``DENSE_MAX_ROWS_PER_EXPERT`` and
``DENSE_MAX_WASTE`` come from. Each schedule's time includes the weighted sum over the slots.

    python benchmarks/bench_moe.py [--dtype bfloat16] [--threads 1] [--rounds 3]

Experts are the zoo targets' (from their config.json: MiniMax-M3's 4 of width 256 and Kimi-K2's
(DeepSeek-V3) 8 of width 96, top-2), with random weights prepacked as the engine does; routing is
random, two distinct experts per token. The two schedules alternate within each round; reported:
the median over rounds of each one's mean microseconds per call, and which one the threshold picks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit

import torch

from specdec.models.layers import silu_and_mul
from specdec.models.moe import FusedExperts
from specdec.zoo import zoo_path

ZOO = ("minimax-m3-tiny", "kimi-k2-tiny")
SIZES = (1, 4, 16, 32, 64, 128, 256, 512)


def experts_of(name: str, dtype: torch.dtype) -> tuple[FusedExperts, int]:
    config = json.loads((zoo_path(name) / "config.json").read_text())
    config = config.get("text_config", config)
    num = config.get("num_local_experts") or config["n_routed_experts"]
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    experts = FusedExperts(num, config["hidden_size"], width, lambda gu: silu_and_mul(*gu.chunk(2, dim=-1)),
                           top_k=config["num_experts_per_tok"])
    torch.nn.init.normal_(experts.gate_up_proj, std=0.02)
    torch.nn.init.normal_(experts.down_proj, std=0.02)
    experts = experts.to(dtype)
    experts.prepack_weights()
    return experts, config["num_experts_per_tok"]


def microseconds(call, reps: int) -> float:
    call()  # warm
    return timeit.timeit(call, number=reps) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    for name in ZOO:
        experts, top_k = experts_of(name, dtype)
        print(f"{name}: {experts.num_experts} experts, top-{top_k}, {args.dtype} (microseconds per call)")
        for tokens in SIZES:
            x = torch.randn(tokens, experts.gate_up_proj.shape[-1], dtype=dtype)
            chosen = torch.stack([torch.randperm(experts.num_experts)[:top_k] for _ in range(tokens)])
            weights = torch.rand(tokens, top_k)
            schedules = {
                "batched": lambda: experts._weighted_sum(experts._every_expert(x, chosen), weights),
                "wide": lambda: experts._dense(x, chosen, weights),
                "routed": lambda: experts._weighted_sum(experts._routed_rows(x, chosen), weights),
            }
            times = {name: [] for name in schedules}
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for name, call in schedules.items():
                        times[name].append(microseconds(call, args.reps))
            batched, wide, routed = (statistics.median(times[k]) for k in schedules)
            picked = "dense" if experts.runs_dense(tokens) else "routed"
            print(f"  {tokens:4d} tokens: dense batched {batched:7.0f}  wide {wide:7.0f}  routed {routed:7.0f}  "
                  f"(routed / wide {routed / wide:.2f}x)  threshold picks {picked}")


if __name__ == "__main__":
    main()
