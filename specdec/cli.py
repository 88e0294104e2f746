"""The ``specdec`` command line: ``specdec generate ...``, ``specdec bench ...`` and ``specdec serve ...``.

Errors (bad arguments, missing folders, unknown names, requests that cannot fit) exit with status
2 and one ``error:`` line on stderr, never a traceback.

With ``--tensor-parallel-size N`` the command is rank 0 and spawns ranks 1..N-1, which re-import the
main module: the ``specdec`` script, ``python -m specdec`` and ``python -m specdec.cli`` all run
:func:`main` only under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Sequence

import attrs

from specdec.bench.config import BenchConfig
from specdec.engine_args import EngineArgs, add_cli_args, cli_values

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
    add_cli_args(gen.add_argument_group("model and engine"), EngineArgs)

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
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")

    out = gen.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object with outputs and spec_stats")
    out.add_argument("--trace", action="store_true",
                     help="also report, per step and request with drafts, the drafts, accepted count and emitted tokens")
    _add_bench_parser(sub)
    _add_serve_parser(sub)
    return parser


_SERVE_EPILOG = """\
examples:
  specdec serve ./minimax-m3-tiny --port 8000 --block-size 128 \\
      --speculative-config.method eagle3 --speculative-config.model ./minimax-m3-tiny-eagle3 \\
      --speculative-config.num_speculative_tokens 3
  lm_eval --model local-completions --tasks TASK \\
      --model_args model=./minimax-m3-tiny,base_url=http://127.0.0.1:8000/v1/completions,num_concurrent=16

vLLM flags that mean nothing here (--gpu-memory-utilization, --compilation-config, --trust-remote-code,
--async-scheduling, --tool-call-parser, ...) are accepted with one warning line each; flag names may
use '_' for '-'.
"""


_SERVE = dict(
    description="Serve a checkpoint over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
    "/detokenize, /tokenizer_info, /health and /metrics, with optional speculative decoding.",
    epilog=_SERVE_EPILOG,
    formatter_class=argparse.RawDescriptionHelpFormatter,
)


def _add_serve_parser(sub) -> None:
    from specdec.server.args import build_parser as build_serve_parser

    build_serve_parser(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (vLLM's flags)", **_SERVE))


def _serve(argv: Sequence[str]) -> int:
    # Parsed apart from the other commands: vLLM's flags and the dotted speculative config are taken
    # out of argv before argparse sees it.
    from specdec.server.args import build_parser as build_serve_parser
    from specdec.server.launch import main as serve

    return serve(build_serve_parser(_Parser(prog="specdec serve", **_SERVE)), argv)


_BENCH_EPILOG = """\
examples:
  specdec bench --model ./tiny --input-len 32 --output-len 32 --num-prompts 16 --concurrency 4 \\
      --speculative-config eagle3:model=./tiny-eagle3,num_speculative_tokens=3 --temperature 0,0.7
  specdec bench --model ./tiny --dataset prompts.jsonl --concurrency 8 --json
  specdec bench --model ./tiny --workload multi-turn --num-turns 4 --no-enable-prefix-caching

the baseline (no speculation) always runs first, on the same prompts (every request ignores EOS, so
both runs generate the same number of tokens), at each --temperature in turn, every run on a fresh
engine. Metrics are vLLM benchmark_serving's: TTFT = first token - arrival, TPOT = (e2e - TTFT) /
(output_len - 1), ITL = gaps between emissions (one gap per step, however many tokens speculation
emitted in it). Prompts are held-out text by default (windows of the training corpus's validation-split
stdlib files, which no zoo model trained on); the table's first line and --json's settings.prompt_source
name the source. Every run reports its prefix-cache hits/queries, every spec run its acceptance per
position and "k chosen": the share of (request, step) pairs given 0..k drafts (adaptive=true in the
speculative config lets the engine choose).
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
    engine = tuple(attrs.fields_dict(EngineArgs))
    add_cli_args(bench.add_argument_group("model and engine"), BenchConfig, only=engine)
    add_cli_args(bench.add_argument_group("workload"), BenchConfig, skip=engine)

    bench.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _generate(args: argparse.Namespace) -> int:
    from specdec.llm import LLM
    from specdec.outputs import StepOutput, trace_entries
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
    llm = LLM.from_engine_args(EngineArgs(**cli_values(args, EngineArgs)))
    steps: list[StepOutput] = []
    outputs = llm.generate(args.prompts, params, on_step=steps.append if args.trace else None)
    llm.close()  # the tensor-parallel workers stop before anything is printed
    stats = llm.spec_stats()
    if args.json:
        result = {
            "outputs": [o.as_dict() for o in outputs],
            "spec_stats": stats.as_dict() if stats is not None else None,
        }
        if args.trace:
            result["trace"] = trace_entries(steps)
        print(json.dumps(result))
        return 0
    for i, o in enumerate(outputs):
        shown = o.text if o.text is not None else " ".join(map(str, o.token_ids))
        print(f"[{i}] ({o.finish_reason}) {shown}")
    if stats is not None:
        print("spec_stats: " + json.dumps(stats.as_dict()))
    if args.trace:
        for entry in trace_entries(steps):
            print("trace: " + json.dumps(entry))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from specdec.bench import format_table, progress_to_stderr, run_benchmark

    config = BenchConfig(**cli_values(args, BenchConfig))
    result = run_benchmark(config, progress=progress_to_stderr)
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["serve"]:
            return _serve(argv[1:])
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
