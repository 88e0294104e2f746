"""Unshifted EAGLE3 with and without KV sharing: the draft pool's bytes per request, and acceptance per
position next to the shifted draft's on the same prompts.

    python benchmarks/bench_unshifted.py [--target DIR --draft DIR [--shifted-draft DIR]] [--k 3]
                                         [--num-prompts 8] [--prompt-len 64] [--max-tokens 48]

Pairs, in order of preference: the folders given; the zoo's ``llama-tiny`` with
``llama-tiny-eagle3-unshifted`` (and ``llama-tiny-eagle3`` as the shifted draft) when built
(``python scripts/build_zoo.py``); else a random Llama with an untrained draft of the right shape,
which gives the memory table only (random weights' acceptance means nothing, so that table is skipped).

Memory: the peak of pages each request holds in the draft pool (true-hidden rows plus the drafting
chain), times the page's bytes. Without sharing the draft keeps every position from 0; with sharing
it keeps none of the prompt's. Acceptance: vLLM's definitions (FACTS.md section 1), greedy; prompts
are windows of the offline validation corpus tokenized by the target's tokenizer (random ids if it
has none). Seed 003 reports mean acceptance length 2.80 shifted vs 2.78 unshifted (k = 3, MT-Bench).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from specdec.train.corpus import validation_prompts

# ----------------------------------------------------------------------------- pairs
def random_pair(root: Path) -> tuple[str, str]:
    """A random Llama (hidden 256, 4 layers, one kv head of 64) and an untrained unshifted draft for it."""
    from bench_decode import small_llama  # the script's folder is on sys.path

    from specdec.train.draft import (
        DraftPreset,
        HFTarget,
        build_draft,
        draft_config_dict,
        resolve_aux_layer_ids,
        save_draft,
    )
    from specdec.train.vocab import frequency_vocab

    vocab_size = 4096
    target_dir = small_llama(str(root / "target"), 256, 4, vocab_size, seed=0)
    target = HFTarget(target_dir, autocast=False)
    preset = DraftPreset(name="bench-unshifted", attention="mha", intermediate_size=512, aux_layer_ids=(0, 1, 2),
                         unshifted=True, kv_sharing=True)
    vocab = frequency_vocab(torch.arange(vocab_size), vocab_size, None)
    aux = resolve_aux_layer_ids(preset, target)
    config = draft_config_dict(preset, target, vocab, aux, kv_layer=target.num_layers - 1)
    draft = build_draft(config, aux, target, vocab, own_lm_head=False, seed=1)
    save_draft(draft, config, vocab, root / "draft", dtype=torch.float32)
    return target_dir, str(root / "draft")


def zoo_pair() -> tuple[str, str, str | None] | None:
    from specdec.zoo import zoo_path

    try:
        target, unshifted = zoo_path("llama-tiny"), zoo_path("llama-tiny-eagle3-unshifted")
    except FileNotFoundError:
        return None
    try:
        shifted = str(zoo_path("llama-tiny-eagle3"))
    except FileNotFoundError:
        shifted = None
    return str(target), str(unshifted), shifted


def target_config(target: str) -> dict:
    """The target's (text) config.json entries."""
    from specdec.models.loader import read_config_json

    config = read_config_json(target)
    return config.get("text_config") or config


def target_vocab(target: str) -> int:
    return int(target_config(target)["vocab_size"])


# ----------------------------------------------------------------------------- measurements
def speculative(method: str, draft: str, k: int, **extra) -> dict:
    return {"method": method, "model": draft, "num_speculative_tokens": k, **extra}


def draft_pool_bytes(target: str, draft: str, k: int, kv_sharing: bool, prompts, max_tokens: int, dtype: str):
    """Peak draft-pool and final target-pool bytes per request for one generate call."""
    from specdec import LLM, SamplingParams

    llm = LLM(target, dtype=dtype, kv_cache_memory=64 << 20,
              speculative_config=speculative("eagle3-unshifted", draft, k, kv_sharing=kv_sharing))
    proposer, cache = llm.engine.proposer, llm.engine.cache
    peak: dict[int, int] = {}
    original = proposer._metadata

    def metadata(requests, positions):
        out = original(requests, positions)  # it has just appended this forward's draft rows
        for r in requests:
            peak[r] = max(peak.get(r, 0), cache.blocks_held(r, proposer.pool))
        return out

    proposer._metadata = metadata
    seen = {}
    original_step = proposer.on_step

    def on_step(feedback):
        for seq in feedback.seqs:
            if not seq.is_finished:  # a finished request's pages are already back
                seen[seq.seq_id] = cache.blocks_held(seq.seq_id, "target")
        return original_step(feedback)

    proposer.on_step = on_step
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    draft_block = cache.pool(proposer.pool).bytes_per_block()
    target_block = cache.pool("target").bytes_per_block()
    n = len(prompts)
    return sum(peak.values()) * draft_block / n, sum(seen.values()) * target_block / n


def acceptance(target: str, spec: dict, prompts, max_tokens: int, dtype: str):
    from specdec import LLM, SamplingParams

    llm = LLM(target, dtype=dtype, kv_cache_memory=64 << 20, speculative_config=spec)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    return llm.spec_stats(), [o.token_ids for o in outputs]


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target checkpoint folder")
    parser.add_argument("--draft", help="unshifted (KV-sharing) EAGLE3 draft folder for --target")
    parser.add_argument("--shifted-draft", help="a shifted EAGLE3 draft for --target, to compare acceptance with")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if bool(args.target) != bool(args.draft):
        parser.error("give --target and --draft together (or neither, for the zoo or a random pair)")
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        shifted, trained = args.shifted_draft, True
        if args.target:
            target, draft, source = args.target, args.draft, "given folders"
        elif (pair := zoo_pair()) is not None:
            (target, draft, shifted), source = pair, "zoo: llama-tiny + llama-tiny-eagle3-unshifted"
        else:
            (target, draft), source, trained = random_pair(Path(tmp)), "random llama 256x4 + untrained draft", False
        print(f"pair: {source}; k={args.k}, {args.dtype}, {args.threads} thread(s)")

        # --- memory
        print("\ndraft pool bytes per request (peak), 2 requests per row, greedy")
        header = f"{'prompt':>6} | {'new':>4} | {'no sharing':>11} | {'sharing':>9} | {'saved':>6} | target pool"
        print(header)
        print("-" * len(header))
        vocab_top = min(1000, target_vocab(target) - 3)
        new = 32
        longest = target_config(target).get("max_position_embeddings", 4096) - new - args.k - 1
        for length in [n for n in (32, 128, 512) if n <= longest]:
            prompts = [[(7 * i + 13 * j) % vocab_top + 3 for j in range(length)] for i in range(2)]
            own, target_bytes = draft_pool_bytes(target, draft, args.k, False, prompts, new, args.dtype)
            shared, _ = draft_pool_bytes(target, draft, args.k, True, prompts, new, args.dtype)
            print(f"{length:>6} | {new:>4} | {own / 1024:>9.1f}Ki | {shared / 1024:>7.1f}Ki | "
                  f"{1 - shared / own:>6.1%} | {target_bytes / 1024:.1f}Ki")

        # --- acceptance
        if not trained:
            print("\nacceptance: skipped (random weights); pass --target/--draft or build the zoo")
            return
        prompts = validation_prompts(target, args.num_prompts, args.prompt_len)
        if prompts is None:
            prompts = [[(31 * i + 7 * j) % vocab_top + 3 for j in range(args.prompt_len)]
                       for i in range(args.num_prompts)]
            print("\n(no tokenizer in the target folder: synthetic prompts)")
        rows = []
        if shifted:
            rows.append(("eagle3, shifted draft", speculative("eagle3", shifted, args.k)))
            rows.append(("unshifted, shifted draft (seed 003 test A)",
                         speculative("eagle3-unshifted", shifted, args.k, kv_sharing=False)))
        rows.append(("unshifted draft, no sharing", speculative("eagle3-unshifted", draft, args.k, kv_sharing=False)))
        rows.append(("unshifted draft, KV sharing", speculative("eagle3-unshifted", draft, args.k, kv_sharing=True)))
        print(f"\nacceptance per position, {len(prompts)} prompts of {args.prompt_len} tokens, "
              f"{args.max_tokens} new tokens, greedy")
        header = f"{'proposer':<44} | {'tau':>5} | {'accept':>6} | per position"
        print(header)
        print("-" * len(header))
        base = None
        for name, spec in rows:
            stats, outputs = acceptance(target, spec, prompts, args.max_tokens, args.dtype)
            base = outputs if base is None else base
            same = "" if outputs == base else "  (outputs differ from the first row: not float64)"
            per = ", ".join(f"{a:.3f}" for a in stats.acceptance_per_position)
            print(f"{name:<44} | {stats.mean_acceptance_length:>5.2f} | {stats.draft_acceptance_rate:>6.1%} | "
                  f"{per}{same}")
        print("seed 003 (vLLM PR #21008, MT-Bench, k=3): shifted 2.80 (0.79, 0.58, 0.42), "
              "unshifted 2.78 (0.78, 0.58, 0.42)")


if __name__ == "__main__":
    main()
