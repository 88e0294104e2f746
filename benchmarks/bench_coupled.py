"""Sampled speculation: the coupled verifier against rejection sampling, and greedy against probabilistic
drafting (issue 24).

    python benchmarks/bench_coupled.py [--pairs llama:eagle3,kimi:eagle3.1-mla,...] [--temperature 0.7,1.0]
        [--k 3] [--num-prompts 16] [--input-len 64] [--output-len 64] [--rounds 3] [--dtype float32]
        [--threads 1] [--json]

Per zoo pair and temperature, three modes over the same held-out prompts (``specdec.bench.workload``'s
windows of the validation split, which no zoo model trained on), every request seeded:

- ``coupled``: ``draft_sample_method=greedy`` (argmax drafts, no q), the engine's default verifier for
  them, the coupled one: the output is plain sampling's, token for token (checked here against a
  plain run, request by request);
- ``rejection``: the same greedy drafts, rejection sampling forced (one-hot q): the same acceptance
  law as ``coupled`` (p of the draft per position), other random numbers, so the two must agree
  within noise;
- ``probabilistic``: ``draft_sample_method=probabilistic`` (drafts drawn from q, q reported),
  rejection sampling: acceptance sum min(p, q) per position.

A round runs every mode once, in an order that alternates between rounds, with seeds of its own
(the modes of a round share them). Printed per mode: acceptance per position and tokens per step
(tau = 1 + accepted / drafts), each +- one standard error over requests (a ratio estimator: a
request's drafts are correlated, requests are not), and for ``rejection`` and ``probabilistic`` their
difference from ``coupled`` in standard errors. Acceptance is a count, not a time: interleaving only
guards the plain-equality check's cost against drift, and ``--threads 1`` keeps the benchmark off the
other cores.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from specdec import LLM, SamplingParams
from specdec.bench.workload import held_out_windows
from specdec.verifiers import RejectionSampler
from specdec.zoo import zoo_path

TARGETS = {"llama": "llama-tiny", "kimi": "kimi-k2-tiny", "minimax": "minimax-m3-tiny"}
PAIRS = "llama:eagle3,llama:draft_model,llama:eagle3-unshifted,kimi:eagle3,kimi:eagle3.1-mla,minimax:eagle3"
MODES = ("coupled", "rejection", "probabilistic")


def spec_config(target: str, method: str, k: int, draft_sample_method: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    draft = "draft-model-tiny" if method == "draft_model" else f"{TARGETS[target]}-{method}"
    return {"method": method, "model": str(zoo_path(draft)), "num_speculative_tokens": k,
            "draft_sample_method": draft_sample_method}


def ratio_with_error(numerators: list[int], denominators: list[int]) -> tuple[float, float]:
    """sum(a) / sum(d) and its standard error over the (a, d) pairs (the ratio estimator's)."""
    total = sum(denominators)
    if total == 0:
        return float("nan"), float("nan")
    rate = sum(numerators) / total
    n = len(denominators)
    spread = sum((a - rate * d) ** 2 for a, d in zip(numerators, denominators))
    return rate, math.sqrt(spread * n / max(n - 1, 1)) / total


class PerRequest:
    """Each request's drafts (steps with drafts) and accepted counts per position, from ``on_step``."""

    def __init__(self, num_requests: int, k: int):
        self.drafts = [0] * num_requests
        self.accepted = [[0] * k for _ in range(num_requests)]

    def __call__(self, step) -> None:
        for request in step.requests:
            if request.draft_token_ids:
                self.drafts[request.index] += 1
                for i in range(request.num_accepted):
                    self.accepted[request.index][i] += 1


# The verifier each mode must have run (greedy requests aside, which no mode here sends).
EXPECTED_VERIFIER = {"coupled": "coupled", "rejection": "rejection", "probabilistic": "rejection"}


def run_mode(llm: LLM, mode: str, prompts, params, k: int) -> tuple[PerRequest, list[list[int]], dict]:
    llm.engine.verifiers.fixed = RejectionSampler() if mode == "rejection" else None
    llm.reset_spec_stats()
    record = PerRequest(len(prompts), k)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False, on_step=record)
    finally:
        llm.engine.verifiers.fixed = None
    by_verifier = dict(llm.spec_stats().num_drafts_by_verifier)
    # A mode whose verifier did not run would print another mode's figures under its name (as the
    # rejection rows did while the engine no longer read the attribute this benchmark set).
    if set(by_verifier) - {EXPECTED_VERIFIER[mode]}:
        raise SystemExit(f"error: mode {mode!r} should verify with {EXPECTED_VERIFIER[mode]!r} but the engine "
                         f"ran {by_verifier}; fix how this benchmark forces the verifier")
    return record, [o.token_ids for o in outputs], by_verifier


def summarise(records: list[PerRequest], k: int) -> dict:
    drafts = [d for r in records for d in r.drafts]
    per_position = [ratio_with_error([a[i] for r in records for a in r.accepted], drafts) for i in range(k)]
    tau, tau_se = ratio_with_error([sum(a) for r in records for a in r.accepted], drafts)
    return {"acceptance_per_position": [p for p, _ in per_position], "acceptance_se": [s for _, s in per_position],
            "tau": 1 + tau, "tau_se": tau_se, "num_drafts": sum(drafts)}


def bench_pair(target: str, method: str, temperatures: list[float], args) -> list[dict]:
    folder = str(zoo_path(TARGETS[target]))
    common = dict(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
    plain = LLM(folder, **common)
    prompts = held_out_windows(plain.tokenizer, [args.input_len] * args.num_prompts)
    llms = {"greedy": LLM(folder, speculative_config=spec_config(target, method, args.k, "greedy"), **common)}
    if method != "ngram":
        llms["probabilistic"] = LLM(folder, speculative_config=spec_config(target, method, args.k, "probabilistic"),
                                    **common)
    modes = [m for m in MODES if m != "probabilistic" or "probabilistic" in llms]
    rows = []
    for temperature in temperatures:
        records: dict[str, list[PerRequest]] = {m: [] for m in modes}
        verified: dict[str, dict] = {m: {} for m in modes}
        reproduced = 0
        for r in range(args.rounds):
            params = [SamplingParams(max_tokens=args.output_len, temperature=temperature, ignore_eos=True,
                                     seed=10_000 * r + i) for i in range(len(prompts))]
            want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
            for mode in modes if r % 2 == 0 else modes[::-1]:
                llm = llms["probabilistic" if mode == "probabilistic" else "greedy"]
                record, got, by_verifier = run_mode(llm, mode, prompts, params, args.k)
                records[mode].append(record)
                for name, count in by_verifier.items():
                    verified[mode][name] = verified[mode].get(name, 0) + count
                if mode == "coupled":
                    reproduced += sum(g == w for g, w in zip(got, want))
        row = {"target": TARGETS[target], "method": method, "temperature": temperature,
               "plain_outputs_reproduced": f"{reproduced}/{args.rounds * len(prompts)}", "modes": {}}
        for mode in modes:
            row["modes"][mode] = {**summarise(records[mode], args.k), "verifiers": verified[mode]}
        rows.append(row)
        print_row(row, args.k)
    return rows


def print_row(row: dict, k: int) -> None:
    base = row["modes"]["coupled"]
    print(f"\n{row['target']} + {row['method']}, T={row['temperature']}, k={k} "
          f"(coupled output == plain sampling: {row['plain_outputs_reproduced']} requests)")
    print(f"  {'mode':<14} {'acceptance per position (+- se)':<{12 * k + 4}} {'tau':>14} {'vs coupled':>11}  verifiers")
    for mode, m in row["modes"].items():
        accept = " ".join(f"{a:.3f}+-{s:.3f}" for a, s in zip(m["acceptance_per_position"], m["acceptance_se"]))
        versus = "" if mode == "coupled" else \
            f"{(m['tau'] - base['tau']) / math.hypot(m['tau_se'], base['tau_se']):+.1f} se"
        print(f"  {mode:<14} {accept:<{12 * k + 4}} {m['tau']:.3f}+-{m['tau_se']:.3f} {versus:>11}  {m['verifiers']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default=PAIRS, help="target:method,... (targets: llama, kimi, minimax; "
                                                       "methods: eagle3, eagle3.1-mla, eagle3-unshifted, draft_model, ngram)")
    parser.add_argument("--temperature", default="0.7,1.0")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="also print every figure as one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    temperatures = [float(t) for t in args.temperature.split(",")]
    print(f"{args.num_prompts} held-out prompts of {args.input_len} tokens, {args.output_len} new tokens each, "
          f"{args.rounds} interleaved rounds, {args.dtype}, {args.threads} thread(s)")
    rows = []
    for pair in args.pairs.split(","):
        target, method = pair.split(":")
        rows += bench_pair(target, method, temperatures, args)
    if args.json:
        print(json.dumps({"settings": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
