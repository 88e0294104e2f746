"""The seeds' test plan, with only the model paths changed (the zoo's Kimi-K2 and MiniMax-M3 pairs) and
TP 1: their ``vllm serve`` command lines start ``specdec serve`` (``--tensor-parallel-size`` is the
engine's flag; every vLLM-only flag is warned about in one line), and their lm_eval command lines, on a local task, run against it."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from live_server import start_cli_server
from lm_eval_tasks import lm_eval, write_tasks
from specdec.zoo import zoo_path

CACHE = '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'
SEEDS = {
    # seed 000: Kimi-K2.6 with its EAGLE3.1-MLA draft
    "kimi": (
        ["kimi-k2-tiny", "--host", "localhost", "--async-scheduling", "--trust-remote-code",
         "--gpu_memory_utilization", "0.8", "--kv-cache-dtype", "fp8", "--no-enable-prefix-caching",
         "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2",
         "--compilation-config", CACHE, "--tensor-parallel-size", "1",
         "--speculative-config.method", "eagle3", "--speculative-config.model", "kimi-k2-tiny-eagle3.1-mla",
         "--speculative-config.num_speculative_tokens", "3"],
        ",num_concurrent=64,max_retries=3,tokenized_requests=False,trust_remote_code=True",
        ["--num_fewshot", "5"],
        7,  # flags warned about
    ),
    # seed 001: MiniMax-M3 with its EAGLE3 draft
    "minimax": (
        ["minimax-m3-tiny", "--host", "localhost", "--no-trust-remote-code", "--dtype", "auto",
         "--kv-cache-dtype", "auto", "--max-model-len", "32768", "--max-num-batched-tokens", "32768",
         "--no-enable-prefix-caching", "--compilation-config", CACHE, "--tensor-parallel-size", "1",
         "--block-size", "128", "--additional-config", '{"online_quant_config": {"global_quant_config": "ptpc_fp8"}}',
         "--language-model-only", "--speculative-config.method", "eagle3",
         "--speculative-config.model", "minimax-m3-tiny-eagle3", "--speculative-config.num_speculative_tokens", "3"],
        ",tokenizer_backend=None,tokenized_requests=False,num_concurrent=128,max_retries=10,max_gen_toks=2048,"
        "timeout=60000",
        ["--batch_size", "auto", "--num_fewshot", "20"],
        5,  # 4 flags warned about, and --max-model-len capped at the model's 8192
    ),
}


def _zoo(argv: list[str]) -> list[str]:
    return [str(zoo_path(a)) if a in ("kimi-k2-tiny", "kimi-k2-tiny-eagle3.1-mla", "minimax-m3-tiny",
                                      "minimax-m3-tiny-eagle3") else a for a in argv]


@pytest.mark.slow
@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_the_seeds_command_lines_start_the_server_and_lm_eval_runs(seed, tmp_path):
    serve_argv, model_args, lm_eval_flags, warned = SEEDS[seed]
    proc, base = start_cli_server(*_zoo(serve_argv))
    try:
        model = str(zoo_path(serve_argv[0]))
        results, samples = lm_eval(model, base, ["specdec_gen"], _tasks(tmp_path), tmp_path / "out",
                                   extra=model_args, cli=(*lm_eval_flags, "--limit", "3"))
        assert len(samples["specdec_gen"]) == 3 and "specdec_gen" in results["results"]
        metrics = httpx.get(f"{base}/metrics").text
        assert "vllm:spec_decode_num_drafts_total" in metrics
        body = {"prompt": "def fibonacci(n):\n", "max_tokens": 8, "temperature": 0, "model": model}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        stderr = proc.stderr.read()
    assert code == 0, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if line.startswith("warning: ")]
    assert len(lines) == warned, lines
    assert "Traceback" not in stderr


def _tasks(folder):
    write_tasks(folder)
    return folder


def test_an_unknown_flag_is_one_error_line(capsys):
    from specdec.cli import main

    assert main(["serve", str(zoo_path("llama-tiny")), "--frobnicate", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--frobnicate" in err[0]
    # --tensor-parallel-size is the engine's own flag: llama-tiny's 4 heads do not split over 3 ranks,
    # which the engine process finds before it starts any worker.
    assert main(["serve", str(zoo_path("llama-tiny")), "--tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "not divisible by tensor_parallel_size 3" in err[0]


def test_the_dotted_form_is_the_json_form():
    from specdec.cli import _Parser
    from specdec.server.args import build_parser, parse_server_args

    dotted, _ = parse_server_args(build_parser(_Parser(prog="x")), [
        "m", "--speculative-config.method", "ngram", "--speculative_config.num_speculative_tokens=4",
        "--speculative-config.prompt_lookup_max", "3"])
    plain, _ = parse_server_args(build_parser(_Parser(prog="x")), [
        "m", "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})])
    assert dotted.speculative_config == plain.speculative_config
    assert dotted.speculative_config.prompt_lookup_min == 3


@pytest.mark.parametrize("flag, enabled", [
    (None, True), ("--enable-prefix-caching", True), ("--enable_prefix_caching", True),
    ("--no-enable-prefix-caching", False), ("--no_enable_prefix_caching", False),
])
def test_prefix_caching_flags_reach_the_engine_without_a_warning(flag, enabled):
    from specdec.cli import _Parser
    from specdec.server.args import build_parser, parse_server_args

    args, warnings = parse_server_args(build_parser(_Parser(prog="x")), ["m", *([flag] if flag else [])])
    assert args.enable_prefix_caching is enabled and warnings == []
