"""``specdec generate``: JSON output, help, and one-line errors with exit 2.

The main paths run as real processes; the long list of error cases calls ``main`` in-process
(the same code, minus a torch import per case).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.zoo import ZOO_DIR


def run(*args: str) -> subprocess.CompletedProcess:
    # python -m keeps the test independent of where the console script was installed.
    return subprocess.run(
        [sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def test_generate_json_with_speculation_and_trace(llama):
    proc = run(
        "generate", "--model", llama, "--dtype", "float64", "--kv-cache-memory", "4M",
        "--speculative-config", "ngram:num_speculative_tokens=3,prompt_lookup_min=1,prompt_lookup_max=2",
        "--prompt-ids", "1,2,3", "--prompt", "def hello ( x ) :", "--prompt-ids", "5,5,5,5",
        "--max-tokens", "12", "--ignore-eos", "--json", "--trace",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result) == {"outputs", "spec_stats", "trace"}
    # Greedy speculation is lossless: the same outputs as the Python API without speculation.
    llm = LLM(llama, dtype="float64", kv_cache_memory=4 << 20)
    prompts = [[1, 2, 3], "def hello ( x ) :", [5, 5, 5, 5]]
    expected = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert result["outputs"] == [o.as_dict() for o in expected]
    assert [o["finish_reason"] for o in result["outputs"]] == ["length"] * 3

    stats, trace = result["spec_stats"], result["trace"]
    assert stats["num_drafts"] == len(trace) > 0
    assert stats["num_draft_tokens"] == sum(len(e["draft_token_ids"]) for e in trace)
    assert stats["num_accepted_tokens"] == sum(e["num_accepted"] for e in trace)
    steps = [(e["step"], e["request"]) for e in trace]
    assert steps == sorted(steps, key=lambda sr: sr[0]) and len(set(steps)) == len(steps)
    for entry in trace:
        a = entry["num_accepted"]
        assert entry["emitted_token_ids"][:a] == entry["draft_token_ids"][:a]
        assert len(entry["emitted_token_ids"]) <= a + 1
        assert 1 <= len(entry["draft_token_ids"]) <= entry["num_drafts_chosen"] <= 3
        # What was emitted is a piece of that request's output.
        out = result["outputs"][entry["request"]]["token_ids"]
        assert any(out[i : i + len(entry["emitted_token_ids"])] == entry["emitted_token_ids"] for i in range(len(out)))


def test_a_draft_for_another_target_is_named_at_load_and_when_acceptance_collapses():
    # issue 23's pair: a draft trained for kimi-k2-tiny, with shapes that fit llama-tiny.
    zoo = ZOO_DIR
    proc = run(
        "generate", "--model", f"{zoo}/llama-tiny", "--dtype", "float32", "--json", "--max-tokens", "16",
        "--speculative-config", f"eagle3:model={zoo}/kimi-k2-tiny-eagle3,num_speculative_tokens=3",
        "--prompt", "def fib(n):", "--prompt", "import os", "--prompt", "class Node:", "--prompt", "for i in",
    )
    assert proc.returncode == 0, proc.stderr
    warnings = json.loads(proc.stdout)["spec_stats"]["warnings"]
    assert proc.stderr.splitlines() == warnings and len(warnings) == 2
    assert "trained for a target (kimi-k2-tiny)" in warnings[0]
    # Four requests, one draft each a step: with none accepted, named on the tenth step of 16 (40 >= 38
    # drafts; 52 with one accepted by chance).
    accepted, drafts = map(int, re.search(r"had (\d+) of (\d+) drafts accepted", warnings[1]).groups())
    assert accepted <= 1 and drafts <= 52 and "eagle3 draft" in warnings[1] and "records 0.873" in warnings[1]


@pytest.mark.slow
def test_generate_on_two_ranks_through_python_m_specdec(llama):
    # python -m specdec: the spawned worker imports the main module again, which must not run the CLI.
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "generate", "--model", llama, "--dtype", "float64", "--kv-cache-memory", "4M",
         "--tensor-parallel-size", "2", "--prompt", "def hello ( x ) :", "--prompt-ids", "5,6,7",
         "--max-tokens", "8", "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    llm = LLM(llama, dtype="float64", kv_cache_memory=4 << 20)
    expected = llm.generate(["def hello ( x ) :", [5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    assert json.loads(proc.stdout)["outputs"] == [o.as_dict() for o in expected]


def test_plain_output_and_help(llama):
    proc = run("generate", "--model", llama, "--prompt", "hello world", "--max-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("[0] (")
    helped = run("generate", "--help")
    assert helped.returncode == 0
    for option in ("--speculative-config", "--prompt-ids", "--kv-cache-memory", "--trace", "examples:"):
        assert option in helped.stdout


def _check_error(code: int, stderr: str, needle: str) -> None:
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert needle in lines[0]
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", "--prompt", "x"], "--model"),
        (["generate", "--model", "/no/such/folder", "--prompt", "x"], "does not exist"),
    ],
)
def test_errors_from_a_real_process(args, needle):
    proc = run(*args)
    _check_error(proc.returncode, proc.stderr, needle)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", "--model", "{llama}"], "--prompt"),
        (["generate", "--model", "{llama}", "--prompt-ids", "1,a"], "--prompt-ids"),
        (["generate", "--model", "{llama}", "--prompt", "x", "--attention-backend", "nope"], "unknown attention backend"),
        (["generate", "--model", "{llama}", "--prompt", "x", "--dtype", "int3"], "unknown dtype"),
        (["generate", "--model", "{llama}", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["generate", "--model", "{llama}", "--prompt", "x", "--kv-cache-memory", "lots"], "kv-cache-memory"),
        (["generate", "--model", "{llama}", "--prompt-ids", "1,2", "--kv-cache-memory", "2K", "--max-tokens", "200"],
         "kv_cache_memory"),
        (["generate", "--model", "{llama}", "--prompt-ids", "1,999"], "vocabulary"),
        (["generate", "--model", "{llama}", "--prompt", "x", "--speculative-config", "warp:k=3"], "warp"),
        (["generate", "--model", "{llama}", "--prompt", "x", "--block-size", "0"], "block_size"),
        (["generate", "--model", "{llama}", "--prompt", "x", "--tensor-parallel-size", "0"], "tensor_parallel_size"),
        # The target's 4 heads do not split over 3 ranks: found before any process starts.
        (["generate", "--model", "{llama}", "--prompt", "x", "--tensor-parallel-size", "3"],
         "(4) is not divisible by tensor_parallel_size 3"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_errors_are_one_line_with_exit_2(args, needle, llama, capsys):
    code = main([a.replace("{llama}", llama) for a in args])
    _check_error(code, capsys.readouterr().err, needle)
