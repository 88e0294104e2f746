"""A MiniMax-M3-shaped target with its EAGLE3 draft, with and without speculation.

    python examples/run_minimax_m3.py

With no arguments it runs offline on the CPU: the bundled tiny MiniMax-M3-shaped target
(``specdec/zoo/minimax-m3-tiny``, trained on the Python standard library) and its EAGLE3 draft
(``minimax-m3-tiny-eagle3``), k=3, 128-token KV pages (MiniMax-M3's block-sparse attention needs
them), a few Python code starts as prompts, one request at a time. It prints the generations,
the acceptance per position, the mean acceptance length and tokens/s with and without speculation.

The same script drives a real checkpoint, mirroring seed 001's server command
(``--speculative-config.method eagle3 --speculative-config.num_speculative_tokens 3
--block-size 128``)::

    python examples/run_minimax_m3.py --model /ckpt/MiniMax-M3 --draft /ckpt/MiniMax-M3-EAGLE3 \\
        --attention-backend aiter --block-size 128 --num-speculative-tokens 3 --max-tokens 256 \\
        --tensor-parallel-size 4

``--tensor-parallel-size N`` splits both engines over N processes (this one and N-1 workers it
starts; ``python examples/run_minimax_m3.py --tensor-parallel-size 2`` on the zoo pair). One
tensor-parallel engine runs at a time in a process, so with N > 1 the two engines run one after the
other (each closed before the next starts) rather than prompt by prompt in turn.

Greedy speculation is lossless, so both runs print the same text (up to rounding in low
precisions). Errors exit with status 2 and one ``error:`` line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EXIT_USAGE = 2
TARGET_ASSET, DRAFT_ASSET = "minimax-m3-tiny", "minimax-m3-tiny-eagle3"

# Code starts: the zoo models learnt the standard library, so these are where they draft well.
DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n",
    "    with open(filename, 'r') as f:\n",
)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="run_minimax_m3.py",
        description="MiniMax-M3(-shaped) target + EAGLE3 draft, with and without speculation.",
    )
    parser.add_argument("--model", metavar="DIR", help=f"target checkpoint (default: the zoo's {TARGET_ASSET})")
    parser.add_argument("--draft", metavar="DIR", help=f"EAGLE3 draft checkpoint (default: the zoo's {DRAFT_ASSET})")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K",
                        help="drafts per step (default: 3)")
    parser.add_argument("--attention-backend", default="torch", metavar="NAME",
                        help="torch | triton | aiter (default: torch)")
    parser.add_argument("--block-size", type=int, default=128, metavar="N", help="target KV page size (default: 128)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="processes the weights and KV heads are split over (default: 1)")
    parser.add_argument("--max-tokens", type=int, default=48, metavar="N", help="tokens per prompt (default: 48)")
    parser.add_argument("--dtype", default="auto", metavar="NAME", help="auto | float32 | float64 | bfloat16 | float16")
    parser.add_argument("--max-model-len", type=int, metavar="N", help="prompt + output tokens per request")
    parser.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                        help="a text prompt (repeat for more; default: a few Python code starts)")
    return parser


def resolve_checkpoints(args: argparse.Namespace) -> tuple[str, str]:
    """The target and draft folders: both given, or both the zoo's."""
    if (args.model is None) != (args.draft is None):
        raise _UsageError("give --model and --draft together (the zoo's draft only fits the zoo's target)")
    if args.model is not None:
        return args.model, args.draft
    from specdec.zoo import zoo_path

    try:
        return str(zoo_path(TARGET_ASSET)), str(zoo_path(DRAFT_ASSET))
    except FileNotFoundError:
        raise _UsageError(
            f"the bundled zoo assets {TARGET_ASSET} / {DRAFT_ASSET} are not built; run `python scripts/build_zoo.py` "
            "or pass --model and --draft"
        ) from None


def timed_generate(llms: dict, prompts, params) -> dict[str, tuple[list, float]]:
    """Each prompt alone (batch 1, where speculation pays most) through every engine in turn, so that
    all meet the same load on a shared machine; per engine its outputs and output tokens/s."""
    for llm in llms.values():
        llm.generate(prompts[:1], params.__class__(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        llm.reset_spec_stats()
    outputs = {name: [] for name in llms}
    wall = dict.fromkeys(llms, 0.0)
    for prompt in prompts:
        for name, llm in llms.items():
            start = time.perf_counter()
            outputs[name] += llm.generate([prompt], params, use_tqdm=False)
            wall[name] += time.perf_counter() - start
    return {name: (outs, sum(len(o.token_ids) for o in outs) / wall[name]) for name, outs in outputs.items()}


def run_engines(builders: dict, prompts, params, tensor_parallel_size: int) -> dict[str, tuple[list, float, object]]:
    """Per engine (built by ``builders[name]()``): its outputs, output tokens/s and speculation stats.

    With one rank both engines are alive together and take the prompts in turn (:func:`timed_generate`);
    a process holds one tensor-parallel engine at a time, so with more each runs alone, then closes."""
    if tensor_parallel_size == 1:
        llms = {name: build() for name, build in builders.items()}
        timed = timed_generate(llms, prompts, params)
        return {name: (*timed[name], llms[name].spec_stats()) for name in llms}
    results = {}
    for name, build in builders.items():
        llm = build()
        try:
            results[name] = (*timed_generate({name: llm}, prompts, params)[name], llm.spec_stats())
        finally:
            llm.close()  # stops its worker processes before the next engine starts its own
    return results


def run(args: argparse.Namespace) -> int:
    for name in ("num_speculative_tokens", "max_tokens", "block_size", "tensor_parallel_size"):
        if getattr(args, name) < 1:
            raise _UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model, draft = resolve_checkpoints(args)
    prompts = list(args.prompts or DEFAULT_PROMPTS)

    from specdec import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": args.num_speculative_tokens}
    common = dict(attention_backend=args.attention_backend, dtype=args.dtype, block_size=args.block_size,
                  max_model_len=args.max_model_len, max_num_seqs=1, tensor_parallel_size=args.tensor_parallel_size)
    ranks = f", tensor parallel {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    print(f"target: {model}\ndraft:  {draft}  (eagle3, k={args.num_speculative_tokens}, block size {args.block_size}, "
          f"backend {args.attention_backend}{ranks})")
    builders = {"spec": lambda: LLM(model, speculative_config=spec, **common), "baseline": lambda: LLM(model, **common)}
    timed = run_engines(builders, prompts, params, args.tensor_parallel_size)
    (baseline, base_tps, _), (outputs, spec_tps, stats) = timed["baseline"], timed["spec"]

    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        shown = out.text if out.text is not None else " ".join(map(str, out.token_ids))
        print(f"--- prompt {i} ({len(out.token_ids)} tokens)\n{prompt}{shown}")
    same = sum(a.token_ids == b.token_ids for a, b in zip(baseline, outputs))
    per_position = ", ".join(f"{a:.3f}" for a in stats.acceptance_per_position)
    print("---")
    print(f"outputs identical without speculation: {same}/{len(prompts)}")
    print(f"acceptance per position: {per_position}  (draft acceptance rate {stats.draft_acceptance_rate * 100:.1f}%)")
    print(f"mean acceptance length: {stats.mean_acceptance_length:.2f}  ({stats.num_drafts} drafts)")
    print(f"tokens/s (batch 1): without speculation {base_tps:.1f}, with eagle3 k={args.num_speculative_tokens} "
          f"{spec_tps:.1f}  (speedup {spec_tps / base_tps:.2f}x)")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(build_parser().parse_args(argv))
    except _UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, OSError, KeyError, RuntimeError, ImportError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Run from a checkout without installing: the package sits one folder up.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
