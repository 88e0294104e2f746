"""The ``specdec`` command line: ``specdec generate ...`` and ``specdec bench ...``.

Errors (bad arguments, missing folders, unknown names, requests that cannot fit) exit with status
2 and one ``error:`` line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Sequence

EXIT_USAGE = 2

_EPILOG = """\
examples:
  specdec generate --model ./tiny --prompt-ids "1,2,3" --max-tokens 8 --json
  specdec generate --model ./tiny --prompt "def fib(n):" --prompt "import os" \\
      --speculative-config ngram:num_speculative_tokens=3 --json --trace
  specdec generate --model ./tiny --prompt "Hello" --temperature 0.8 --top-p 0.9 --seed 1

speculative configs (both forms are equivalent):
  ngram:num_speculative_tokens=3,prompt_lookup_max=4
  '{"method": "draft_model", "model": "./draft", "num_speculative_tokens": 3}'
"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one ``error:`` line (no usage dump) and exits 2."""

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


class _UsageError(Exception):
    pass


class _PromptAction(argparse.Action):
    """``--prompt`` and ``--prompt-ids`` append to one list, so mixed prompts keep their order."""

    def __call__(self, parser, namespace, value, option_string=None):
        prompts = getattr(namespace, self.dest, None) or []
        if self.const == "ids":
            value = _parse_ids(value, parser)
        namespace.prompts = [*prompts, value]


def _parse_ids(text: str, parser: argparse.ArgumentParser) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(re.fullmatch(r"\d+", p) for p in parts):
        parser.error(f"--prompt-ids wants comma-separated non-negative token ids like '1,2,3', got {text!r}")
    return [int(p) for p in parts]


def _byte_size(text: str) -> int:
    """``1048576``, ``64M``, ``2G``, ``512K`` (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)i?[bB]?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a number of bytes like 67108864 or 64M, got {text!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match.group(2).lower()]
    return int(match.group(1)) * scale


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specdec",
        description="Speculative decoding for LLM inference (n-gram, draft models, EAGLE3) over a paged KV cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    gen = sub.add_parser(
        "generate",
        help="generate from prompts with a checkpoint folder",
        description="Generate continuations of one or more prompts, optionally with speculative decoding.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = gen.add_argument_group("model and engine")
    model.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder (config.json + *.safetensors)")
    model.add_argument(
        "--speculative-config",
        metavar="STR",
        help="'method:key=value,...' or a JSON object; methods: ngram, draft_model, eagle3, ... (default: none)",
    )
    model.add_argument("--attention-backend", default="torch", metavar="NAME", help="torch | triton | aiter (default: torch)")
    model.add_argument(
        "--dtype", default="auto", metavar="NAME", help="auto | float32 | float64 | bfloat16 | float16 (default: auto)"
    )
    model.add_argument("--block-size", type=int, metavar="N", help="target KV page size (default: the model's/backend's)")
    model.add_argument(
        "--kv-cache-memory", type=_byte_size, metavar="BYTES", help="bytes for all KV pools, e.g. 67108864 or 64M"
    )
    model.add_argument("--max-model-len", type=int, metavar="N", help="prompt + output tokens per request")
    model.add_argument("--max-num-seqs", type=int, default=256, metavar="N", help="requests running at once (default: 256)")

    prompts = gen.add_argument_group("prompts (at least one; repeat to batch, order is kept)")
    prompts.add_argument("--prompt", dest="prompts", action=_PromptAction, const="text", metavar="TEXT",
                         help="a text prompt (needs tokenizer files in the model folder)")
    prompts.add_argument("--prompt-ids", dest="prompts", action=_PromptAction, const="ids", metavar='"1,2,3"',
                         help="a prompt as comma-separated token ids")

    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=16, metavar="N", help="tokens to generate at most (default: 16)")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default: 0)")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1] (default: 1 = off)")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (default: 0 = off)")
    sampling.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the run's sampling (default: 0)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")

    out = gen.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object with outputs and spec_stats")
    out.add_argument("--trace", action="store_true",
                     help="also report, per step and request with drafts, the drafts, accepted count and emitted tokens")
    _add_bench_parser(sub)
    return parser


_BENCH_EPILOG = """\
examples:
  specdec bench --model ./tiny --input-len 32 --output-len 32 --num-prompts 16 --concurrency 4 \\
      --speculative-config eagle3:model=./tiny-eagle3,num_speculative_tokens=3
  specdec bench --model ./tiny --dataset prompts.jsonl --concurrency 8 --json

the baseline (no speculation) always runs first, on the same prompts (every request ignores EOS, so
both runs generate the same number of tokens). Metrics are vLLM benchmark_serving's: TTFT = first
token - arrival, TPOT = (e2e - TTFT) / (output_len - 1), ITL = gaps between emissions (one gap per
step, however many tokens speculation emitted in it).
"""


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="offline serving benchmark, with and without speculation",
        description="Serve a prompt set at a fixed concurrency without and with speculation; print vLLM-style "
        "serving metrics (Req/s, tok/s, TTFT, TPOT, ITL), their deltas and the acceptance per position.",
        epilog=_BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = bench.add_argument_group("model and engine")
    model.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder (config.json + *.safetensors)")
    model.add_argument("--speculative-config", metavar="STR",
                       help="the spec run's config, 'method:key=value,...' or JSON (default: baseline only)")
    model.add_argument("--attention-backend", default="torch", metavar="NAME",
                       help="torch | triton | aiter (default: torch)")
    model.add_argument("--dtype", default="auto", metavar="NAME",
                       help="auto | float32 | float64 | bfloat16 | float16 (default: auto)")
    model.add_argument("--block-size", type=int, metavar="N",
                       help="target KV page size (default: the model's/backend's)")
    model.add_argument("--kv-cache-memory", type=_byte_size, metavar="BYTES", help="bytes for all KV pools, e.g. 64M")
    model.add_argument("--max-model-len", type=int, metavar="N",
                       help="prompt + output tokens per request (default: longest prompt + --output-len)")
    model.add_argument("--max-num-seqs", type=int, metavar="N",
                       help="engine's running requests (default: --concurrency)")

    work = bench.add_argument_group("workload")
    work.add_argument("--dataset", metavar="FILE.jsonl",
                      help='prompts, one {"prompt": str} or {"prompt_token_ids": [...]} a line (default: synthetic)')
    work.add_argument("--num-prompts", type=int, metavar="N",
                      help="prompts to run (default: 16 synthetic, or the whole dataset)")
    work.add_argument("--input-len", type=int, default=64, metavar="N", help="synthetic prompt length (default: 64)")
    work.add_argument("--output-len", type=int, default=64, metavar="N",
                      help="tokens generated per request (default: 64)")
    work.add_argument("--concurrency", type=int, default=4, metavar="N", help="requests in flight at most (default: 4)")
    work.add_argument("--warmup", type=int, default=1, metavar="N", help="uncounted requests run first (default: 1)")
    work.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default: 0)")
    work.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the prompts and sampling (default: 0)")

    bench.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _generate(args: argparse.Namespace) -> int:
    from specdec.llm import LLM
    from specdec.sampling.params import SamplingParams

    if not args.prompts:
        raise _UsageError("give at least one --prompt or --prompt-ids (see 'specdec generate --help')")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(
        model=args.model,
        speculative_config=args.speculative_config,
        attention_backend=args.attention_backend,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    llm.engine.record_trace = args.trace
    outputs = llm.generate(args.prompts, params)
    stats = llm.spec_stats()
    if args.json:
        result = {
            "outputs": [o.as_dict() for o in outputs],
            "spec_stats": stats.as_dict() if stats is not None else None,
        }
        if args.trace:
            result["trace"] = llm.engine.trace
        print(json.dumps(result))
        return 0
    for i, o in enumerate(outputs):
        shown = o.text if o.text is not None else " ".join(map(str, o.token_ids))
        print(f"[{i}] ({o.finish_reason}) {shown}")
    if stats is not None:
        print("spec_stats: " + json.dumps(stats.as_dict()))
    if args.trace:
        for entry in llm.engine.trace:
            print("trace: " + json.dumps(entry))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from specdec.bench import BenchConfig, format_table, progress_to_stderr, run_benchmark

    config = BenchConfig(
        model=args.model,
        speculative_config=args.speculative_config,
        attention_backend=args.attention_backend,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        dataset=args.dataset,
        concurrency=args.concurrency,
        warmup=args.warmup,
        seed=args.seed,
        temperature=args.temperature,
    )
    result = run_benchmark(config, progress=progress_to_stderr)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        if args.command == "bench":
            return _bench(args)
        return _generate(args)
    except _UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, OSError, KeyError, RuntimeError, ImportError) as err:
        # One line: the library's messages name the problem and the fix.
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
