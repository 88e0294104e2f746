"""A draft's layers served from bf16 weights against int8 and int4 ones (the speculative config's
``quantization``), by rows per forward: where ``specdec.models.quantization.MAX_KERNEL_ROWS`` comes from.

    python benchmarks/bench_quantized_linear.py [--target specdec/zoo/minimax-m3-tiny]
        [--draft specdec/zoo/minimax-m3-tiny-eagle3] [--dtype bfloat16] [--copies 24] [--rounds 5]

The layers are the served draft's (every linear and the rows its logits read), loaded by the engine.
In serving, the target's forward evicts the draft's weights from the caches between draft steps, so
each configuration runs ``--copies`` copies of the layers in turn (more bytes than the last-level
cache holds), each layer once per copy: what is timed is a draft step's layers read from memory.
Per configuration and row count: the median over rounds (configurations alternating within each) of
microseconds per pass over the layers, the quantized ones through torch's packed kernels at every row
count, marked where the engine takes them (past those rows it runs the bf16 GEMM over the dequantized
weights, the bf16 column).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import LLM
from specdec.models.layers import Linear, linear, onednn_prepack
from specdec.models.quantization import MAX_KERNEL_ROWS, SCHEMES, quantize

ROWS = (1, 2, 3, 4, 6, 8, 16)


def served_layers(args) -> list[torch.Tensor]:
    """The draft's weights as served: its linear layers and its logits' rows."""
    spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": 1}
    draft = LLM(args.target, speculative_config=spec, dtype=args.dtype, kv_cache_memory=1 << 24).engine.proposer.draft
    return [m.weight.detach() for m in draft.modules() if isinstance(m, Linear)] + [draft.logits_weight()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="specdec/zoo/minimax-m3-tiny")
    parser.add_argument("--draft", default="specdec/zoo/minimax-m3-tiny-eagle3")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--copies", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    weights = served_layers(args)
    print(f"{args.draft}: {len(weights)} layers, {sum(w.numel() for w in weights) * weights[0].element_size() / 1e6:.1f} MB "
          f"as {args.dtype}; {args.copies} copies")
    layers = {"bf16": [], **{scheme: [] for scheme in SCHEMES}}  # per configuration: per copy, its layers' runners
    for _ in range(args.copies):
        copies = [w.clone() for w in weights]
        layers["bf16"].append([(w, onednn_prepack(w), None) for w in copies])
        for scheme in SCHEMES:
            quantized = [quantize(w, scheme) for w in copies]
            layers[scheme].append([(q, onednn_prepack(q), packed) for q, packed in quantized])
    print(f"{'rows':>5s}" + "".join(f"{name:>16s}" for name in layers))
    for rows in ROWS:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(weights[0].dtype) for w in weights}
        seconds = {name: [] for name in layers}
        for _ in range(args.rounds):
            for name, copies in layers.items():
                started = time.perf_counter()
                for copy in copies:
                    for weight, prepacked, packed in copy:
                        x = inputs[weight.shape[1]]
                        packed(x) if packed is not None else linear(x, weight, prepacked=prepacked)
                seconds[name].append((time.perf_counter() - started) / len(copies))
        cells = []
        for name in layers:
            kernel = name in MAX_KERNEL_ROWS and rows <= MAX_KERNEL_ROWS[name]
            cells.append(f"{statistics.median(seconds[name]) * 1e6:9.0f} us" + (" (k)" if kernel else "    "))
        print(f"{rows:5d}" + "".join(f"{c:>16s}" for c in cells))
    print("int8, int4: torch's packed kernels at every row count; (k): the engine serves this many rows through\n"
          "them, more through the bf16 GEMM over the dequantized weights (the bf16 column)")


if __name__ == "__main__":
    main()
