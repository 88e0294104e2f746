"""Decode throughput of the engine on the CPU, and the share of a step spent outside the model.

    python benchmarks/bench_decode.py [--batches 1,4,16,64] [--steps 32] [--threads 1]

A small random Llama (about 7M parameters, float32) is written to a temporary folder. For each
batch size the requests are prefilled, then ``--steps`` decode steps are timed. "outside" is
the step time not spent in the model's forward and LM head: scheduling, metadata, slot
allocation, sampling and bookkeeping (target: under 15% at batch 1).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def small_llama(folder: str, hidden: int, layers: int, vocab: int, seed: int = 0) -> str:
    """A random Llama checkpoint (heads of 64, GQA 4:1 from hidden 256 up) written to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
                         max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


class _Timed:
    """Adds up the wall time of calls to one bound method."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.total += time.perf_counter() - start
        return out


def bench(folder: str, batch: int, steps: int, prompt_len: int) -> tuple[float, float, float]:
    from specdec import LLM, SamplingParams

    llm = LLM(folder, dtype="float32", kv_cache_memory=256 << 20, max_num_seqs=batch)
    engine, model = llm.engine, llm.engine.model
    forward, logits = _Timed(model.forward), _Timed(model.compute_logits)
    model.forward, model.compute_logits = forward, logits  # instance attributes shadow the methods
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(prompt_len)] for i in range(batch)]
    for i, p in enumerate(prompts):
        engine.add_request(p, params, index=i)
    engine.step()  # all prefills
    engine.step()  # warm-up decode
    forward.total = logits.total = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    inside = forward.total + logits.total
    while engine.has_unfinished():
        engine.step()
    return batch * steps / wall, wall / steps * 1e3, 1.0 - inside / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = small_llama(tmp, args.hidden, args.layers, args.vocab)
        print(f"model: llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}, float32, "
              f"torch backend, {args.threads} thread(s), prompt {args.prompt_len} tokens")
        print(f"{'batch':>5} | {'tokens/s':>9} | {'ms/step':>8} | {'outside model':>13}")
        print("-" * 46)
        for batch in (int(b) for b in args.batches.split(",")):
            tps, ms, outside = bench(folder, batch, args.steps, args.prompt_len)
            print(f"{batch:>5} | {tps:>9.1f} | {ms:>8.2f} | {outside:>12.1%}")


if __name__ == "__main__":
    main()
