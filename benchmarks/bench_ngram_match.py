"""Which earlier match should ``ngram`` draft from? Acceptance and wall time of candidate rules.

All rules look up the same thing, every earlier occurrence of the longest recurring suffix
(``suffix_match_ends``), and differ only in which occurrence they copy from:

- ``recent``: the most recent occurrence, cut at the end of the text (specdec before this benchmark;
  a match close to the end drafts fewer than k tokens).
- ``earliest``: the earliest occurrence (vLLM's rule).
- ``longest``: the occurrence with the longest continuation (at most k), the most recent among equals.
- ``frequency``: position by position, the token that most often follows among the occurrences that
  still agree with the draft so far (the most recent one's on a tie).
- ``repeating``: the most recent occurrence, its copy running on into its own output when fewer than
  k tokens follow it (a match p tokens back repeats the last p tokens); ``frequency+repeating``
  counts occurrences extended the same way. ``repeating`` is what ``ngram_propose`` does.

Every rule runs through the engine (``specdec.LLM``, method ``ngram``), swapped in for
``ngram_propose``; the figures are ``llm.spec_stats()``: tokens per draft (num_draft_tokens /
num_drafts), acceptance per position and tau (mean acceptance length, 1 + accepted / drafts).
Greedy output is the target's whatever the rule, so the ``same`` column counts prompts whose tokens
equal plain decoding's. Times are medians over ``--rounds`` interleaved rounds (each round runs every
row once, in an order that rotates), with one compute thread by default; ``none`` is plain decoding.

Prompt sets: ``held-out``, consecutive windows of ``--input-len`` tokens of held-out text (the
training corpus's validation split, which no zoo model trained on), always; ``peer``, with
``--prompts FILE``, the peer harness's prompts (``python ../shared/peer/make_prompts.py FILE``: the
first 700 characters of 16 standard-library modules, 145-276 tokens).

    python benchmarks/bench_ngram_match.py --prompts /tmp/ngram_prompts.json [--ks 3,5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from unittest import mock

import numpy as np
import torch

from specdec.proposers import ngram as ngram_module
from specdec.proposers.ngram import ngram_propose, suffix_match_ends

_EMPTY = np.empty(0, dtype=np.int64)


def _after(seq: np.ndarray, end: int, k: int) -> np.ndarray:
    return seq[end + 1 : end + 1 + k].astype(np.int64)


def recent(seq, k, min_n, max_n):
    ends = suffix_match_ends(seq, min_n, max_n)
    return _after(seq, int(ends[-1]), k) if ends.size and k else _EMPTY


def earliest(seq, k, min_n, max_n):
    ends = suffix_match_ends(seq, min_n, max_n)
    return _after(seq, int(ends[0]), k) if ends.size and k else _EMPTY


def longest(seq, k, min_n, max_n):
    ends = suffix_match_ends(seq, min_n, max_n)
    if not ends.size or not k:
        return _EMPTY
    room = np.minimum(len(seq) - 1 - ends, k)
    return _after(seq, int(ends[np.flatnonzero(room == room.max())[-1]]), k)


def frequency(seq, k, min_n, max_n, repeat=False):
    alive = suffix_match_ends(seq, min_n, max_n)
    out = []
    for j in range(k):
        if repeat:
            at = alive + 1 + j % (len(seq) - 1 - alive)
        else:
            alive = alive[alive + 1 + j < len(seq)]
            at = alive + 1 + j
        if not alive.size:
            break
        following = seq[at]
        values, counts = np.unique(following, return_counts=True)
        top = np.isin(following, values[counts == counts.max()])
        token = following[np.flatnonzero(top)[-1]]  # a tie goes to the most recent occurrence
        out.append(int(token))
        alive = alive[following == token]
    return np.asarray(out, dtype=np.int64)


RULES = {
    "recent": recent,
    "earliest": earliest,
    "longest": longest,
    "frequency": frequency,
    "repeating": ngram_propose,
    "frequency+repeating": functools.partial(frequency, repeat=True),
}


def prompt_sets(args, tokenizer) -> dict[str, list]:
    from specdec.bench.workload import held_out_windows

    sets = {}
    if args.prompts:
        with open(args.prompts) as f:
            sets["peer"] = [p["text"] for p in json.load(f)]
    sets["held-out"] = held_out_windows(tokenizer, [args.input_len] * args.held_out)
    return sets


def generate(llm, prompts, params, batch):
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
    return [list(o.token_ids) for o in outs]


def run_set(args, prompts, params) -> list[dict]:
    from specdec import LLM

    common = dict(dtype=args.dtype, seed=0, max_model_len=args.input_len + args.max_tokens + 512,
                  max_num_seqs=args.batch, kv_cache_memory=256 << 20)
    plain = LLM(args.model, **common)
    rows = [{"rule": "none", "k": 0, "llm": plain, "patch": None}]
    for k in args.ks:
        spec = {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_min": args.lookup[0], "prompt_lookup_max": args.lookup[1]}
        llm = LLM(args.model, speculative_config=spec, **common)
        rows += [{"rule": name, "k": k, "llm": llm, "patch": RULES[name]} for name in args.rules]
    warm = type(params)(max_tokens=16, temperature=params.temperature, ignore_eos=True)
    for row in rows[:1] + rows[1 :: len(args.rules)]:  # each LLM once, on a full batch
        generate(row["llm"], prompts[: args.batch], warm, args.batch)
    for r in range(args.rounds):
        shift = r % len(rows)
        for row in rows[shift:] + rows[:shift]:
            llm = row["llm"]
            if row["patch"] is not None:
                llm.reset_spec_stats()
            with mock.patch.object(ngram_module, "ngram_propose", row["patch"] or ngram_propose):
                start = time.perf_counter()
                tokens = generate(llm, prompts, params, args.batch)
                row.setdefault("seconds", []).append(time.perf_counter() - start)
            if r == 0:
                row["tokens"] = tokens
                row["stats"] = llm.spec_stats().as_dict() if row["patch"] is not None else None
    base = rows[0]
    for row in rows:
        row["same"] = sum(a == b for a, b in zip(row["tokens"], base["tokens"]))
        row["ntokens"] = sum(map(len, row["tokens"]))
    return rows


def table(name: str, rows: list[dict], num: int) -> list[dict]:
    base_s = statistics.median(rows[0]["seconds"])
    print(f"\n{name}: {num} prompts")
    print(f"{'rule':>20} {'k':>2} {'drafts':>6} {'tok/draft':>9} {'tau':>6} {'s':>7} {'x none':>6} {'same':>5}  acceptance per position")
    out = []
    for row in rows:
        s = statistics.median(row["seconds"])
        st = row["stats"]
        rec = {"set": name, "rule": row["rule"], "k": row["k"], "seconds": s, "speedup": base_s / s,
               "same_as_none": row["same"], "prompts": num, "tokens": row["ntokens"]}
        if st:
            n = st["num_drafts"]
            rec |= {"num_drafts": n, "tokens_per_draft": st["num_draft_tokens"] / n if n else 0.0,
                    "tau": st["mean_acceptance_length"], "acceptance_per_position": st["acceptance_per_position"]}
            acc = " ".join(f"{a:.3f}" for a in rec["acceptance_per_position"])
            print(f"{row['rule']:>20} {row['k']:>2} {n:>6} {rec['tokens_per_draft']:>9.2f} {rec['tau']:>6.3f} "
                  f"{s:>7.2f} {rec['speedup']:>6.2f} {row['same']:>5}  {acc}")
        else:
            print(f"{row['rule']:>20} {'-':>2} {'':>6} {'':>9} {'':>6} {s:>7.2f} {1.0:>6.2f} {row['same']:>5}")
        out.append(rec)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="specdec/zoo/llama-tiny")
    parser.add_argument("--prompts", help="the peer harness's prompts.json (make_prompts.py); adds the 'peer' set")
    parser.add_argument("--held-out", type=int, default=64, help="held-out prompts (default 64)")
    parser.add_argument("--input-len", type=int, default=200, help="tokens per held-out prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ks", default="3,5", help="num_speculative_tokens values, comma-separated")
    parser.add_argument("--lookup", default="2,3", help="prompt_lookup_min,max (the peer harness's: 2,3)")
    parser.add_argument("--rules", default=",".join(RULES), help=f"comma-separated, of {', '.join(RULES)}")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds (median)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per generate() call")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; e.g. 0.7 for sampled")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    args.ks = [int(k) for k in args.ks.split(",")]
    args.lookup = [int(n) for n in args.lookup.split(",")]
    args.rules = args.rules.split(",")
    unknown = set(args.rules) - set(RULES)
    if unknown:
        parser.error(f"unknown rules {sorted(unknown)}; choose from {', '.join(RULES)}")
    torch.set_num_threads(args.threads)
    from specdec import SamplingParams
    from specdec.tokenizer import load_tokenizer

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0, ignore_eos=True)
    print(f"{args.model}, {args.dtype}, T={args.temperature}, {args.max_tokens} new tokens, "
          f"lookup {args.lookup[0]}..{args.lookup[1]}, batch {args.batch}, {args.threads} thread(s), "
          f"{args.rounds} round(s)")
    records = []
    for name, prompts in prompt_sets(args, load_tokenizer(args.model)).items():
        records += table(name, run_set(args, prompts, params), len(prompts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
