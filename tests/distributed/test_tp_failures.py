"""Tensor-parallel failures are one line, never a hang nor a traceback.

- A worker that dies (killed here) makes the driver exit non-zero with one stderr line naming the
  rank: whether the driver was idle (its watchdog notices) or stepping (its next collective finds
  the rank gone). Run as a user's script, in a process of its own, since the driver exits.
- A size that does not shard the target is a one-line ``ValueError`` (``error:`` line and exit 2
  from the CLI) before any process starts, at once.
- A draft that does not shard fails once the workers are up: one line too, and no process is left.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specdec
from specdec import LLM
from specdec.cli import main
from specdec.zoo import zoo_path

DIES = """
import sys, time
from specdec import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float64", kv_cache_memory=1 << 22, tensor_parallel_size=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([[1, 2, 3]], params, use_tqdm=False)
    print("generated", flush=True)
    worker = llm._workers._processes[1]
    worker.kill()
    worker.join()
    if sys.argv[2] == "idle":
        time.sleep(120)  # a server between requests: only the watchdog can notice
    else:
        llm.generate([[4, 5, 6]], params, use_tqdm=False)
    print("the driver went on", flush=True)
"""


@pytest.mark.parametrize("when", ["idle", "stepping"])
def test_a_worker_that_dies_makes_the_driver_exit_with_one_line_naming_it(when, tmp_path: Path):
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    root = str(Path(specdec.__file__).resolve().parents[1])  # the script runs from tmp_path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), str(zoo_path("llama-tiny")), when], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180, env=env)
    assert "generated" in done.stdout, done.stderr[-3000:]
    assert "the driver went on" not in done.stdout
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and "rank 1" in lines[0], done.stderr[-3000:]
    assert time.monotonic() - started < 120  # not the idle script's sleep: the watchdog ended it


@pytest.fixture
def no_process_starts(monkeypatch):
    """Any multiprocessing process started inside the test fails it."""

    def start(process):
        raise AssertionError(f"a process was started: {process.name}")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)


# Heads that do not split: 4 over 3; 6 over 4; MiniMax-M3's 2 KV heads over 3 (a KV head is replicated
# only when the ranks are a multiple of the KV heads); llama-tiny's 4 query heads over 8 ranks (query
# heads are never replicated: only KV heads are).
UNSHARDABLE = [
    ("llama-tiny", 3, "num_attention_heads (4)"),
    ("kimi-k2-tiny", 3, "num_attention_heads (4)"),
    ("minimax-m3-tiny", 4, "num_attention_heads (6)"),
    ("minimax-m3-tiny", 3, "num_key_value_heads (2)"),
    ("llama-tiny", 8, "num_attention_heads (4)"),
]


@pytest.mark.parametrize("model,size,what", UNSHARDABLE, ids=[f"{m}-tp{s}" for m, s, _ in UNSHARDABLE])
def test_a_size_that_does_not_shard_is_one_line_before_any_process_starts(model, size, what, no_process_starts):
    started = time.monotonic()
    with pytest.raises(ValueError) as err:
        LLM(str(zoo_path(model)), dtype="float64", tensor_parallel_size=size)
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    assert what in message and f"tensor_parallel_size {size}" in message, message
    assert time.monotonic() - started < 10  # built on the meta device: nothing loads
    assert multiprocessing.active_children() == []


def test_the_cli_reports_it_as_one_error_line_with_exit_2(capsys, no_process_starts):
    code = main(["generate", "--model", str(zoo_path("llama-tiny")), "--tensor-parallel-size", "3",
                 "--prompt-ids", "1,2,3"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "num_attention_heads" in lines[0] and "tensor_parallel_size" in lines[0]
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def three_head_draft(tiny_checkpoint, tmp_path_factory) -> Path:
    """A draft for conftest's tiny llama (its vocabulary) with 3 attention heads: it does not split in two."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=24, num_hidden_layers=1, num_attention_heads=3,
                         num_key_value_heads=3, intermediate_size=32, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("three_head_draft")
    AutoModelForCausalLM.from_config(config, dtype=torch.float64).save_pretrained(folder)
    return folder


def test_a_draft_that_does_not_shard_is_one_line_and_leaves_no_process(tiny_checkpoint, three_head_draft):
    spec = {"method": "draft_model", "model": str(three_head_draft), "num_speculative_tokens": 2}
    started = time.monotonic()
    with pytest.raises(ValueError) as err:
        LLM(str(tiny_checkpoint("llama")), dtype="float64", kv_cache_memory=1 << 20, speculative_config=spec,
            tensor_parallel_size=2)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and "num_attention_heads (3)" in message, message
    assert time.monotonic() - started < 60
    assert multiprocessing.active_children() == []
