"""The adaptive controller against fixed k and no speculation, at several concurrencies (issue 20).

    python benchmarks/bench_adaptive.py [--target specdec/zoo/minimax-m3-tiny]
        [--draft specdec/zoo/minimax-m3-tiny-eagle3] [--k 3] [--concurrency 1,4,16,32]
        [--rounds 3] [--output-len 64] [--output-spread 0.5] [--temperature 0] [--dtype bfloat16] [--control]
        [--quantization int8|int4]

Prompts: windows of the training corpus's validation documents (``specdec.train.corpus``, the split
the zoo drafts never trained on), ``--input-len`` tokens each. Every configuration (no speculation,
EAGLE3 at each fixed k up to ``--k``, and ``adaptive=true`` with cap ``--k``) is one ``LLM``, built
afresh every round, in an order that alternates between rounds: where an engine's memory lands gives
it an offset of a few percent for as long as it lives (two identical plain engines in one process
differed by up to 2%, a dormant adaptive engine and a plain one by -2% to +6% depending on which was
built first), which interleaved trials do not cancel; each round's engines land elsewhere.
Concurrency c keeps c requests in flight, as a serving benchmark's ``--max-concurrency`` does
(``specdec.bench.runner.serve``: a request goes in as soon as one finishes), over ``--batches`` times c
prompts, and at least ``--min-prompts``. Output lengths (``ignore_eos``) are drawn once, uniformly
within ``--output-spread`` of ``--output-len`` (vLLM's ``--random-range-ratio``), the same for every
configuration: with equal lengths, requests without speculation would finish in lockstep and the next
ones' prompts would all run in one large forward, an advantage no real load gives; static batches
would understate speculation instead (requests that accept less finish later, and their batch runs on
nearly empty).

Prefix caching is off. Every level and round serves the same prompts again, so with it on, every
prefill after the first would come from the cache, which no held-out load does. It also charged
``adaptive`` alone for the reuse while a dormant request matched the draft's pools too: a later request
reusing its prompt ran the target over it again for hidden states no draft would read (a c16 round with
every request dormant read 0.88x of none with caching, 1.01x without). A request starting dormant now
matches the target's pools alone, but one that drafts after a dormant one with the same prompt still
runs it again, as it must.

The machine's speed drifts (up to 1.7x between runs a minute apart on the shared development
machine), so configurations are compared in *trials*: every configuration runs the same prompts, one
after another, in an order that alternates between trials, and ratios are taken within a trial. A
round runs every level once; a level's prompts make one trial, or at low concurrency several of
``--slice`` prompts (at least 2c, so that each keeps the level's steady state and drain). Reported per
level: output tok/s and each configuration's ratio to no speculation and to the best fixed k, medians
over trials. The best fixed k is the one an operator would pick from this run: the fixed k with the
highest median rate at that level; each configuration is compared with that engine trial by trial.
The ratio to the fastest fixed k of each trial is printed beside it, in brackets, and is stricter than
it should be: it takes the largest of several noisy readings, so an engine identical to the best fixed
k reads below 1 by it on average wherever two fixed k run close (``--control`` adds such an engine, a
second one at fixed k = ``--k``, to show what each figure makes of noise alone; ``--quantization`` runs
every speculative engine with the draft's weights quantized, and adds one at fixed k = ``--k`` without,
for what the quantization gains). The adaptive rows show
the controller's choices in every round (``num_drafts_histogram``: one engine serves every level of a
round in turn, so what it chooses at a level may depend on the levels run before) and the controller's own cost:
the seconds the engine spent in it (:class:`ControllerClock`, timed in place while it served the level)
per step, and as a share of its steps' time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench.runner import serve
from specdec.bench.workload import output_lengths
from specdec.models.quantization import SCHEMES
from specdec.tokenizer import encode
from specdec.train.corpus import load_documents


def held_out_prompts(llm: LLM, count: int, input_len: int) -> list[list[int]]:
    """``count`` windows of ``input_len`` tokens from the validation documents, at most two per document."""
    prompts = []
    for doc in load_documents("validation"):
        ids = encode(llm.tokenizer, doc.text)
        for start in range(0, len(ids) - input_len, max(input_len, len(ids) // 2)):
            if len(prompts) < count:
                prompts.append(ids[start : start + input_len])
    if len(prompts) < count:
        raise SystemExit(f"the validation split holds only {len(prompts)} windows of {input_len} tokens")
    return prompts


def throughput(llm: LLM, prompts, concurrency: int, params: list[SamplingParams]) -> tuple[float, list]:
    """Output tokens per second with ``concurrency`` requests in flight, and each request's tokens."""
    _, _, duration, outputs = serve(llm.engine, prompts, params, concurrency)
    return sum(map(len, outputs)) / duration, outputs


class ControllerClock:
    """Seconds an adaptive engine spends in its controller (every method the engine calls on it: the
    choice, admission, waking, the step's marks, what it learns), timed in place while it serves."""

    METHODS = ("choose", "admit", "to_wake", "observe_verified", "forget", "step_began", "lap", "step_ended")

    def __init__(self, controller):
        self.seconds = 0.0
        for name in self.METHODS:
            setattr(controller, name, self._timed(getattr(controller, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="specdec/zoo/minimax-m3-tiny")
    parser.add_argument("--draft", default="specdec/zoo/minimax-m3-tiny-eagle3")
    parser.add_argument("--method", default="eagle3")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--batches", type=int, default=2, help="c prompts this many times at concurrency c")
    parser.add_argument("--min-prompts", type=int, default=16, help="at least this many prompts at every level")
    parser.add_argument("--slice", type=int, default=4, help="prompts per interleaved trial (at least 2c at level c)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output-spread", type=float, default=0.5, help="lengths within this fraction of it")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quantization", choices=SCHEMES,
                        help="the draft's weight quantization in every speculative engine (adds one without, at fixed k=--k)")
    parser.add_argument("--control", action="store_true",
                        help="add a second engine at fixed k=--k: what noise alone reads against the best fixed k")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]

    def spec(k: int, adaptive: bool = False, quantization: str | None = args.quantization) -> dict:
        return {"method": args.method, "model": args.draft, "num_speculative_tokens": k, "adaptive": adaptive,
                "quantization": quantization}

    configs = {"none": None, **{f"k={k}": spec(k) for k in range(1, args.k + 1)}, f"adaptive k<={args.k}": spec(args.k, True)}
    if args.control:
        configs[f"k={args.k} again"] = spec(args.k)
    if args.quantization:
        configs[f"k={args.k} unquantized"] = spec(args.k, quantization=None)
    count = {c: max(c * args.batches, args.min_prompts) for c in levels}  # prompts per level
    common = dict(dtype=args.dtype, max_num_seqs=max(levels), kv_cache_memory=512 << 20, seed=0,
                  enable_prefix_caching=False)  # prompts repeat across levels and rounds (the docstring)
    spread = round(args.output_len * args.output_spread)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=args.temperature, seed=1)
              for n in output_lengths(max(count.values()), args.output_len, args.output_spread, seed=0)]
    adaptive = [name for name in configs if name.startswith("adaptive")]
    spent = {(name, c): [0.0, 0, 0.0] for name in adaptive for c in levels}  # controller s, steps, serving s
    prompts: list[list[int]] = []

    def build(round_index: int) -> tuple[dict[str, LLM], dict[str, ControllerClock]]:
        """Every configuration's engine, built in an order that alternates between rounds and warmed up,
        and the adaptive ones' controller clocks (the docstring)."""
        names = list(configs) if round_index % 2 == 0 else list(reversed(configs))
        built = {name: LLM(args.target, speculative_config=configs[name], **common) for name in names}
        if not prompts:
            prompts.extend(held_out_prompts(built["none"], max(count.values()), args.input_len))
        for llm in built.values():  # warm-up
            llm.generate(prompts[:2], params[:2], use_tqdm=False)
        return {name: built[name] for name in configs}, {name: ControllerClock(built[name].engine.draft_counts)
                                                         for name in adaptive}

    # A trial runs every configuration on the same prompts, one after another, in an order that
    # alternates between trials; ratios are taken within a trial. At low concurrency a level's prompts
    # are cut into trials of --slice prompts (at least 2c, which keeps a level's steady state and drain),
    # so that no configuration runs more than seconds away from the others on a drifting machine.
    trials = {c: [] for c in levels}  # per level: per trial, configuration -> output tok/s
    histograms = {c: [] for c in levels}  # the adaptive configuration's choices, round by round
    outputs = {}  # first round's tokens per (configuration, concurrency)
    llms: dict[str, LLM] = {}
    for r in range(args.rounds):
        llms.clear()
        gc.collect()  # the last round's engines (their KV caches) go before this round's are built
        llms, clocks = build(r)
        for c in levels:
            batch = prompts[: count[c]]
            size = max(args.slice, 2 * c)
            for name in adaptive:
                llms[name].reset_spec_stats()
            first = len(trials[c])  # this round's trials at this level start here
            for start in range(0, len(batch), size):
                part = slice(start, start + size)
                order = list(configs) if len(trials[c]) % 2 == 0 else list(reversed(configs))
                trial = {}
                for name in order:
                    before = (clocks[name].seconds, llms[name].engine.stats.num_steps) if name in clocks else None
                    trial[name], tokens = throughput(llms[name], batch[part], c, params[part])
                    if before is not None:
                        totals = spent[name, c]
                        totals[0] += clocks[name].seconds - before[0]
                        totals[1] += llms[name].engine.stats.num_steps - before[1]
                        totals[2] += sum(map(len, tokens)) / trial[name]
                    if r == 0:
                        outputs.setdefault((name, c), []).extend(tokens)
                trials[c].append(trial)
            for name in adaptive:
                histograms[c].append(llms[name].spec_stats().num_drafts_histogram)
            print(f"round {r + 1} c={c}: " + "  ".join(
                f"{n} {statistics.median(t[n] for t in trials[c][first:]):.0f}" for n in configs), flush=True)

    print(f"\n{args.target} + {args.method} {args.draft}, {args.dtype}, T={args.temperature}, "
          f"{args.output_len} +- {spread} new tokens, held-out prompts of {args.input_len} tokens, {args.rounds} rounds")
    fixed = [f"k={k}" for k in range(1, args.k + 1)]
    for c in levels:
        best = max(fixed, key=lambda f: statistics.median(t[f] for t in trials[c]))
        print(f"\nconcurrency {c} ({len(trials[c])} interleaved trials; best fixed k by median rate: {best})")
        for name in configs:
            rates = [t[name] for t in trials[c]]
            vs_none = statistics.median(t[name] / t["none"] for t in trials[c])
            vs_best = statistics.median(t[name] / t[best] for t in trials[c])
            fastest = statistics.median(t[name] / max(t[f] for f in fixed) for t in trials[c])
            line = (f"  {name:14s} {statistics.median(rates):8.1f} tok/s  x{vs_none:.2f} of none  "
                    f"x{vs_best:.2f} of best fixed k (x{fastest:.2f} of each trial's fastest)")
            identical = sum(a == b for a, b in zip(outputs[name, c], outputs["none", c]))
            line += f"  outputs identical to none {identical}/{len(outputs[name, c])}"
            if name in clocks:
                controller, steps, serving = spent[name, c]
                line += (f"  drafts chosen (0..k) by round {histograms[c]}  controller {controller / steps * 1e3:.3f} ms "
                         f"a step = {100 * controller / serving:.2f}% of its steps ({serving / steps * 1e3:.1f} ms)")
            print(line)


if __name__ == "__main__":
    main()
