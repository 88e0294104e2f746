"""Tensor parallelism on the zoo MiniMax-M3 pair: what two ranks send per step, and TP=2 vs TP=1 speed.

    python benchmarks/bench_tp.py [--dtypes bfloat16,float32] [--rounds 5] [--batch 4] [--tp1-threads 1,2]
                                  [--draft-tensor-parallel-size 1|2]

The pair is the zoo's ``minimax-m3-tiny`` with its EAGLE3 draft, k=3, greedy, 128-token pages. The
prompts are consecutive, non-overlapping windows of held-out text (the training corpus's validation
split, which no zoo model trained on), cut by ``specdec.bench.workload.held_out_windows`` as
``specdec bench`` cuts its shared-prefix and multi-turn workloads; every round takes fresh windows, so
no round reuses pages an earlier one cached, and both engines of a round get the same ones.

Per dtype, a TP=1 engine and a TP=2 engine (this process as rank 0 and one worker it spawns) are both
alive and take turns, A B A B ..., one ``generate`` call of ``--batch`` prompts each per round; the
table gives medians over the rounds. Each TP=2 rank computes with its share of the cores (on two
cores, one thread per rank); TP=1 runs once per round for each ``--tp1-threads`` count (default: one
thread and every core), and TP=2 is compared with the faster. Both are worth seeing: a tiny model's
small ops gain little from a second thread, and on a machine other processes keep busy they lose
much more than that to thread hand-offs (on the shared two-core machine this was written on, TP=1
ran 118 tok/s on two threads and 99 on one when it was idle, 8 and 77 when it was not).

Communication is ``specdec.distributed.parallel_state.counter`` on the driver (what rank 0 sends; a
ring all-reduce of n bytes over p ranks sends 2 (p - 1) / p n, an all-gather (p - 1) n), read around
every engine step of the TP=2 runs and split by phase: ``target`` (the target's forward and logits,
per engine step), ``draft`` (inside ``proposer.propose``, per call: the catch-up over the verified
tokens and k draft forwards) and ``control`` (the per-step broadcast of added and aborted requests).
Prefill steps (a request's first token) are reported apart from decode steps, whose target forward
verifies 1 + drafts rows per request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench.workload import HELD_OUT, held_out_windows
from specdec.distributed import parallel_state as ps
from specdec.tokenizer import load_tokenizer

ZOO = "specdec/zoo/"
PHASES = ("target", "draft", "control")


class Traffic:
    """Per engine step of a TP=2 engine: the counter's bytes and calls by phase, the step's kind and rows."""

    def __init__(self, llm: LLM):
        self.steps: list[dict] = []
        self.propose_calls = 0
        self._seen: set[int] = set()
        proposer = llm.engine.proposer
        if proposer is not None:
            propose = proposer.propose

            def counted(*args, **kwargs):
                self.propose_calls += 1
                return propose(*args, **kwargs)

            proposer.propose = counted  # an instance attribute: only this engine's calls are counted

    def on_step(self, out) -> None:
        first = any(r.index not in self._seen for r in out.requests)
        self._seen.update(r.index for r in out.requests)
        rows = sum(1 + len(r.draft_token_ids) for r in out.requests)
        self.steps.append({"prefill": first, "rows": rows, "bytes": dict(ps.counter.bytes),
                           "calls": dict(ps.counter.calls), "draft_calls": self.propose_calls})
        ps.counter.reset()
        self.propose_calls = 0

    def start(self) -> None:
        ps.counter.reset()
        self.propose_calls = 0
        self._seen.clear()


def timed(llm: LLM, prompts, params, *, threads: int, on_step=None) -> tuple[list, float]:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, on_step=on_step)
    seconds = time.perf_counter() - start
    return outs, sum(len(o.token_ids) for o in outs) / seconds


def summarize_traffic(steps: list[dict], k: int) -> list[tuple[str, str]]:
    """Lines of the communication table: per phase, bytes and calls per step."""
    def per(kind: str, phase: str, what: str, divide_by: str | None = None) -> list[float]:
        chosen = [s for s in steps if s["prefill"] == (kind == "prefill")]
        values = []
        for s in chosen:
            n = s[what].get(phase, 0)
            if divide_by is not None:
                if not s[divide_by]:
                    continue
                n /= s[divide_by]
            values.append(n)
        return values

    def med(values):
        return statistics.median(values) if values else float("nan")

    decode = [s for s in steps if not s["prefill"]]
    rows = med([s["rows"] for s in decode])
    lines = []
    for kind in ("prefill", "decode"):
        n = sum(1 for s in steps if s["prefill"] == (kind == "prefill"))
        target_b, target_c = med(per(kind, "target", "bytes")), med(per(kind, "target", "calls"))
        draft_b = med(per(kind, "draft", "bytes", "draft_calls"))
        draft_c = med(per(kind, "draft", "calls", "draft_calls"))
        control = per(kind, "control", "bytes")
        control_s = f"{med(control):,.0f} B" if any(control) else "not counted"
        draft_s = (f"draft {draft_b:,.0f} B in {draft_c:.0f} calls/propose ({draft_b / k:,.0f} B per draft "
                   f"forward of k={k})" if draft_b else "draft sends nothing")
        lines.append((f"{kind} steps ({n})",
                      f"target {target_b:,.0f} B in {target_c:.0f} calls/step; {draft_s}; control {control_s}"))
    decode_bytes = med(per("decode", "target", "bytes"))
    lines.append(("decode rows", f"{rows:.0f} target rows/step (1 + drafts per request): "
                                 f"{decode_bytes / rows:,.0f} target B per row"))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=ZOO + "minimax-m3-tiny")
    parser.add_argument("--draft", default=ZOO + "minimax-m3-tiny-eagle3")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batch", type=int, default=4, help="prompts per generate call (all in flight together)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--draft-tensor-parallel-size", type=int, default=None, metavar="N",
                        help="the TP=2 engine's speculative config draft_tensor_parallel_size: 2 splits the "
                             "draft's decoder layer over the ranks, 1 keeps it whole (default: the proposer's)")
    parser.add_argument("--tp1-threads", default=None,
                        help="comma-separated thread counts the TP=1 engine runs with, each its own column "
                             "(default: 1 and the number of cores)")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    tp1_threads = sorted({int(t) for t in args.tp1_threads.split(",")} if args.tp1_threads else {1, cores})

    spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.k}
    dtypes = args.dtypes.split(",")
    # Fresh windows per dtype and round (plus one warm-up batch per dtype), the same for both engines.
    per_dtype = args.batch * (args.rounds + 1)
    windows = held_out_windows(load_tokenizer(args.model), [args.input_len] * per_dtype * len(dtypes))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    per_rank = max(1, cores // 2)
    common = dict(speculative_config=spec, block_size=128, kv_cache_memory=256 << 20, max_num_seqs=args.batch)
    draft_tp = ("" if args.draft_tensor_parallel_size is None
                else f", TP=2 draft_tensor_parallel_size={args.draft_tensor_parallel_size}")
    print(f"{args.model} + {args.draft} (eagle3 k={args.k}{draft_tp}), greedy; prompts: {args.batch} per call, "
          f"{args.input_len} tokens each, {HELD_OUT}, fresh each round; {args.output_len} output tokens each; "
          f"{cores} cores; medians of {args.rounds} interleaved rounds")

    for d, dtype in enumerate(dtypes):
        batches = [windows[(d * per_dtype) + i * args.batch:(d * per_dtype) + (i + 1) * args.batch]
                   for i in range(args.rounds + 1)]
        one = LLM(args.model, dtype=dtype, **common)
        two_spec = dict(spec) if args.draft_tensor_parallel_size is None else {
            **spec, "draft_tensor_parallel_size": args.draft_tensor_parallel_size}
        two = LLM(args.model, dtype=dtype, tensor_parallel_size=2, **{**common, "speculative_config": two_spec})
        # (label, engine, threads, one rank?): TP=1 at each --tp1-threads, TP=2 on its share of the
        # cores per rank; A B (C) A B (C) ...
        engines = [(f"TP=1, {t} thread{'s' * (t > 1)}", one, t, True) for t in tp1_threads]
        engines.append((f"TP=2, {per_rank}/rank", two, per_rank, False))
        try:
            traffic = Traffic(two)
            for _, llm, threads, _ in engines:  # warm-up
                timed(llm, batches[0], params, threads=threads)
            speeds: dict[str, list[float]] = {label: [] for label, *_ in engines}
            outputs: dict[str, list] = {label: [] for label, *_ in engines}
            for r in range(1, args.rounds + 1):
                for label, llm, threads, single in engines:
                    if not single:
                        traffic.start()
                    outs, tps = timed(llm, batches[r], params, threads=threads,
                                      on_step=None if single else traffic.on_step)
                    speeds[label].append(tps)
                    outputs[label] += [o.token_ids for o in outs]
            tau = {True: one.spec_stats().mean_acceptance_length, False: two.spec_stats().mean_acceptance_length}
        finally:
            two.close()
        first, last = engines[0][0], engines[-1][0]
        same = sum(a == b for a, b in zip(outputs[first], outputs[last]))
        print(f"\n{dtype}")
        print(f"  {'engine':16s} {'out tok/s (median)':>19s} {'rounds':>32s} {'tau':>5s}")
        for label, _, _, single in engines:
            rounds = " ".join(f"{x:.1f}" for x in speeds[label])
            print(f"  {label:16s} {statistics.median(speeds[label]):19.1f} {rounds:>32s} {tau[single]:5.2f}")
        best = max(statistics.median(speeds[label]) for label, *_ in engines[:-1])
        print(f"  TP=2 / best TP=1: {statistics.median(speeds[last]) / best:.2f}x; "
              f"outputs identical TP=2 vs TP=1: {same}/{len(outputs[last])}")
        print("  communication per step at TP=2 (rank 0 sends; medians over the rounds' steps):")
        for label, text in summarize_traffic(traffic.steps, args.k):
            print(f"    {label:18s} {text}")


if __name__ == "__main__":
    main()
