"""specdec against transformers' assisted generation at batch 1, same target, same small draft model.

    python benchmarks/bench_assisted.py [--target DIR --draft-model DIR [--eagle3 DIR]] [--k 3]
                                        [--num-prompts 6] [--prompt-len 64] [--max-tokens 64]

Defaults: the zoo's ``llama-tiny`` target, ``draft-model-tiny`` as the small draft LM, and
``llama-tiny-eagle3`` as specdec's EAGLE3 head (``python scripts/build_zoo.py`` builds them).
Every row runs the same validation-corpus prompts one at a time, greedy, in the same dtype, the rows
taking turns prompt by prompt (``--repeats`` passes) so that all of them meet the same load:

- transformers ``generate`` without and with ``assistant_model`` (its default dynamic number of
  assistant tokens, and a constant ``--k`` to match specdec's);
- specdec without speculation and with ``draft_model``, ``eagle3`` and ``ngram`` (k = ``--k``).

Printed: output tokens/s, the ratio to transformers' assisted generation (the best of its two
schedules), and how many outputs equal transformers' plain greedy ones (float32 rounding may flip
a near-tie; float64 makes them all equal).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from specdec.train.corpus import validation_prompts


def zoo_defaults() -> tuple[str, str, str | None]:
    from specdec.zoo import zoo_path

    try:
        eagle3 = str(zoo_path("llama-tiny-eagle3"))
    except FileNotFoundError:
        eagle3 = None
    return str(zoo_path("llama-tiny")), str(zoo_path("draft-model-tiny")), eagle3


def transformers_runner(target, assistant, max_tokens: int, k: int | None):
    """Greedy ``generate`` of one prompt; with ``assistant`` its assisted loop (``k``: constant draft length)."""
    kwargs = {}
    if assistant is not None:
        config = copy.deepcopy(assistant.generation_config)
        config.num_assistant_tokens = k or 20  # transformers' default is 20
        config.num_assistant_tokens_schedule = "constant" if k else "heuristic"
        config.assistant_confidence_threshold = 0.0 if k else 0.4
        kwargs["assistant_model"] = assistant

        def one(prompt: list[int], new: int = max_tokens) -> list[int]:
            # The heuristic schedule adapts num_assistant_tokens on the assistant's config and carries it
            # to the next call, as transformers intends; the two schedules share one assistant, so each
            # keeps its own config across calls.
            assistant.generation_config = config
            return generate(prompt, new)
    else:
        def one(prompt: list[int], new: int = max_tokens) -> list[int]:
            return generate(prompt, new)

    def generate(prompt: list[int], new: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=target.config.pad_token_id, **kwargs)
        return out[0, len(prompt):].tolist()

    return one, lambda: None


def specdec_runner(target: str, spec: dict | None, max_tokens: int, dtype: str):
    """One prompt through an ``LLM`` (batch 1), and its mean acceptance length so far."""
    from specdec import LLM, SamplingParams

    llm = LLM(target, dtype=dtype, max_num_seqs=1, speculative_config=spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def one(prompt: list[int], new: int = max_tokens) -> list[int]:
        sp = params if new == max_tokens else SamplingParams(max_tokens=new, ignore_eos=True)
        return llm.generate([prompt], sp, use_tqdm=False)[0].token_ids

    def tau() -> float | None:
        stats = llm.spec_stats()
        return stats.mean_acceptance_length if stats is not None and spec else None

    return one, tau


def run_interleaved(runners: dict, prompts: list[list[int]], repeats: int):
    """Every runner on every prompt, taking turns prompt by prompt so that all meet the same load on a
    shared machine, ``repeats`` times. Returns per runner: its outputs (last pass) and output tokens/s."""
    for one, _ in runners.values():
        one(prompts[0], 4)  # warm-up
    elapsed = dict.fromkeys(runners, 0.0)
    tokens = dict.fromkeys(runners, 0)
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        outputs = {label: [] for label in runners}
        for prompt in prompts:
            for label, (one, _) in runners.items():
                start = time.perf_counter()
                out = one(prompt)
                elapsed[label] += time.perf_counter() - start
                tokens[label] += len(out)
                outputs[label].append(out)
    return {label: (outputs[label], tokens[label] / elapsed[label]) for label in runners}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target checkpoint (default: the zoo's llama-tiny)")
    parser.add_argument("--draft-model", help="small draft LM sharing the tokenizer (default: draft-model-tiny)")
    parser.add_argument("--eagle3", help="EAGLE3 head for the target (default: llama-tiny-eagle3)")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens for specdec and constant transformers")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts, every run taking turns")
    args = parser.parse_args()
    if bool(args.target) != bool(args.draft_model):
        parser.error("give --target and --draft-model together (or neither, for the zoo)")
    torch.set_num_threads(args.threads)
    target_dir, draft_dir, eagle3_dir = (
        (args.target, args.draft_model, args.eagle3) if args.target else zoo_defaults()
    )
    prompts = validation_prompts(target_dir, args.num_prompts, args.prompt_len)
    if not prompts:
        parser.error(f"{target_dir} has no tokenizer; the benchmark needs one for its prompts")

    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # min_new_tokens (our ignore_eos) draws a deprecation note
    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()
    print(f"target {target_dir}\ndraft model {draft_dir}\neagle3 {eagle3_dir}\n"
          f"{len(prompts)} prompts of {args.prompt_len} tokens, {args.max_tokens} new, batch 1, greedy, "
          f"{args.dtype}, {args.threads} threads")

    runners = {"transformers generate": transformers_runner(target, None, args.max_tokens, None),
               "transformers assisted (dynamic)": transformers_runner(target, assistant, args.max_tokens, None),
               f"transformers assisted (k={args.k})": transformers_runner(target, assistant, args.max_tokens, args.k)}
    specs: list[tuple[str, dict | None]] = [("specdec, no speculation", None),
                                             (f"specdec draft_model k={args.k}",
                                              {"method": "draft_model", "model": draft_dir,
                                               "num_speculative_tokens": args.k})]
    if eagle3_dir:
        specs.append((f"specdec eagle3 k={args.k}",
                      {"method": "eagle3", "model": eagle3_dir, "num_speculative_tokens": args.k}))
    specs.append((f"specdec ngram k={args.k}", {"method": "ngram", "num_speculative_tokens": args.k}))
    for label, spec in specs:
        runners[label] = specdec_runner(target_dir, spec, args.max_tokens, args.dtype)

    results = run_interleaved(runners, prompts, args.repeats)
    reference = results["transformers generate"][0]
    assisted_best = max(tps for label, (_, tps) in results.items() if label.startswith("transformers assisted"))
    rows = [(label, outputs, tps, runners[label][1]()) for label, (outputs, tps) in results.items()]

    header = f"{'run':<36} | {'tok/s':>7} | {'vs assisted':>11} | {'tau':>5} | same as transformers greedy"
    print(header)
    print("-" * len(header))
    for label, outputs, tps, tau in rows:
        same = sum(a == b for a, b in zip(outputs, reference))
        tau_text = f"{tau:>5.2f}" if tau is not None else f"{'-':>5}"
        print(f"{label:<36} | {tps:>7.1f} | {tps / assisted_best:>10.2f}x | {tau_text} | {same}/{len(reference)}")


if __name__ == "__main__":
    main()
