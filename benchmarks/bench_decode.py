"""Decode throughput of the plain engine on the CPU, the share of a step spent outside the model, and
where a decode step's time goes.

    python benchmarks/bench_decode.py [--batches 1,4,16,64] [--steps 32] [--threads 1]
    python benchmarks/bench_decode.py --model specdec/zoo/llama-tiny --dtype bfloat16 \
        --prompts prompts.json --batches 1,8 --steps 128 --breakdown

Without ``--model`` a small random Llama (about 7M parameters) is written to a temporary folder.
Prompts are synthetic ``--prompt-len`` token runs, or the texts of a JSON list of ``{"text": ...}``
(the peer harness's ``make_prompts.py`` writes one), cycled to fill the batch. For each batch size
the requests are prefilled, then ``--steps`` decode steps are timed, each step's output fed to an
``OutputProcessor`` as ``LLM.generate`` does. "outside" is the step time not spent in the model's
forward and LM head (target: under 15% at batch 1).

``--breakdown`` charges every step's wall time to phases, each phase its own time without the phases
nested in it (wrapping the calls costs about a microsecond each), and prints the mean ms per step of
each, beside "pure compute": the last step's forward and logits re-run on the same tensors.

Old code against new: the script imports ``specdec`` from ``PYTHONPATH``, so run it alternately over
an export of each commit (``git archive REV specdec | tar -x -C DIR``), A B A B, in fresh processes.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
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


class PhaseClock:
    """Exclusive wall time per phase of the calls it wraps: a wrapped call is charged its own time
    less that of the wrapped calls inside it, so the phases add up to the time they cover."""

    def __init__(self):
        self.totals: dict[str, float] = collections.defaultdict(float)
        self.last_args: dict[str, tuple] = {}  # each phase's latest call
        self._nested: list[float] = []  # per open call: time spent in wrapped calls inside it
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, phase: str) -> None:
        """Time ``owner.name`` (a class's function or an instance's method) as ``phase``."""
        fn = getattr(owner, name)
        saved = vars(owner).get(name, _MISSING)  # the raw attribute (a classmethod stays one)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            self.last_args[phase] = args
            self._nested.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.totals[phase] += elapsed - self._nested.pop()
                if self._nested:
                    self._nested[-1] += elapsed

        setattr(owner, name, timed)
        self._undo.append((owner, name, saved))

    def restore(self) -> None:
        for owner, name, saved in reversed(self._undo):
            if saved is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)
        self._undo.clear()


_MISSING = object()


def instrument(clock: PhaseClock, engine, processor) -> None:
    """Wrap the calls of a plain decode step, phase by phase (the README's step: scheduler -> forward ->
    sampler -> commit, and the front end's output processing)."""
    from specdec.models.layers import Linear, RMSNorm, RotaryEmbedding
    from specdec.models.moe import FusedExperts
    from specdec.models.parallel import RowParallelLinear
    from specdec.runtime.layout import StepLayout
    from specdec.sampling.sampler import SamplingBatch

    for owner, name, phase in [
        (engine, "step", "engine glue"),  # the step's own lines: what no phase below covers
        (engine.scheduler, "schedule", "schedule"),
        (StepLayout, "build", "layout"),
        (StepLayout, "__getattr__", "layout"),  # attrs' slotted cached properties: positions, verify rows
        (engine.runner, "context", "slots + metadata"),
        (engine.runner, "run", "host -> tensor"),  # its own lines: the input ids tensor
        (engine.model, "forward", "model glue"),  # residual adds, activations, views
        (engine.model, "embed", "embedding"),
        (RotaryEmbedding, "at", "rotary"),
        (RotaryEmbedding, "rotate", "rotary"),
        (Linear, "forward", "linear layers"),
        (RowParallelLinear, "forward", "linear layers"),
        (RMSNorm, "forward", "norms"),
        (engine.runner.backend, "write_kv", "kv write"),
        (engine.runner.backend, "attention", "attention"),
        (engine.runner.backend, "mla_attention", "attention"),
        (FusedExperts, "forward", "moe experts"),
        (engine.model, "compute_logits", "logits"),
        (SamplingBatch, "for_sequences", "sampling"),
        (engine.sampler, "sample", "sampling"),
        (engine, "_commit", "commit"),
        (processor, "process", "output processing"),
    ]:
        clock.wrap(owner, name, phase)


def load_prompts(path: str | None, tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    if path is None:
        return [[(7 * i + j) % 1000 + 3 for j in range(prompt_len)] for i in range(batch)]
    texts = [p["text"] for p in json.load(open(path))]
    return [tokenizer.encode(texts[i % len(texts)]) for i in range(batch)]


def pure_compute(model, input_ids: torch.Tensor, positions: torch.Tensor, ctx, repeats: int = 20) -> float:
    """Seconds per forward + logits of one decode step's rows (every row samples), all tensors built
    once (its KV slots are rewritten with the same values)."""
    with torch.inference_mode():
        def once():
            return model.compute_logits(model.forward(input_ids, positions, ctx).hidden_states)

        once()
        start = time.perf_counter()
        for _ in range(repeats):
            once()
    return (time.perf_counter() - start) / repeats


def bench(llm, prompts: list[list[int]], steps: int, breakdown: bool) -> dict:
    from specdec import SamplingParams
    from specdec.output_processor import OutputProcessor

    engine, model = llm.engine, llm.engine.model
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    processor = OutputProcessor(llm.tokenizer)
    for i, p in enumerate(prompts):
        seq = engine.add_request(p, params, index=i)
        processor.add(seq.seq_id, i, p, params)
    while any(seq.num_output_tokens == 0 for seq in engine.scheduler.running + list(engine.scheduler.waiting)):
        processor.process(engine.step())  # prefills (chunked or not)
    processor.process(engine.step())  # warm-up decode

    model_clock, clock = PhaseClock(), PhaseClock()  # the model's own time (forward + LM head); the phases
    model_clock.wrap(model, "forward", "forward")  # instance attributes over the methods
    model_clock.wrap(model, "compute_logits", "logits")
    if breakdown:
        instrument(clock, engine, processor)
    start, cpu_start = time.perf_counter(), time.thread_time()
    try:
        for _ in range(steps):
            processor.process(engine.step())
    finally:
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
        clock.restore()
        model_clock.restore()
    inside = sum(model_clock.totals.values())
    result = {"tok_s": len(prompts) * steps / wall, "ms": wall / steps * 1e3, "cpu_ms": cpu / steps * 1e3,
              "outside": 1.0 - inside / wall, "phases": {k: v / steps * 1e3 for k, v in clock.totals.items()}}
    if breakdown:
        result["pure_ms"] = pure_compute(model, *model_clock.last_args["forward"][:3]) * 1e3
    while engine.has_unfinished():
        engine.step()
    return result


def print_breakdown(batch: int, result: dict) -> None:
    phases = sorted(result["phases"].items(), key=lambda kv: -kv[1])
    print(f"\nbatch {batch}: {result['ms']:.2f} ms/step ({sum(result['phases'].values()):.2f} in phases), "
          f"pure compute (forward + logits on fixed tensors) {result['pure_ms']:.2f} ms")
    for name, ms in phases:
        print(f"  {name:<20} {ms:>7.3f} ms  {ms / result['ms']:>6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: a small random Llama)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", default=None, help='JSON list of {"text": ...} (default: synthetic prompts)')
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--breakdown", action="store_true", help="per-phase ms per decode step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specdec import LLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or small_llama(tmp, args.hidden, args.layers, args.vocab)
        what = args.model or f"random llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}"
        print(f"model: {what}, {args.dtype}, {args.threads} thread(s), "
              f"prompts: {args.prompts or f'synthetic, {args.prompt_len} tokens'}")
        batches = [int(b) for b in args.batches.split(",")]
        results = {}
        for batch in batches:
            llm = LLM(folder, dtype=args.dtype, kv_cache_memory=256 << 20, max_num_seqs=batch, max_model_len=2048)
            prompts = load_prompts(args.prompts, llm.tokenizer, batch, args.prompt_len)
            results[batch] = bench(llm, prompts, args.steps, args.breakdown)
        print(f"{'batch':>5} | {'tokens/s':>9} | {'ms/step':>8} | {'cpu ms/step':>11} | {'outside model':>13}")
        print("-" * 60)
        for batch, r in results.items():
            print(f"{batch:>5} | {r['tok_s']:>9.1f} | {r['ms']:>8.2f} | {r['cpu_ms']:>11.2f} | {r['outside']:>12.1%}")
        if args.breakdown:
            for batch, r in results.items():
                print_breakdown(batch, r)


if __name__ == "__main__":
    main()
