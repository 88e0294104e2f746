"""``specdec serve ... --tensor-parallel-size 2`` as a user runs it: the command line in a process of its
own (the engine process then starts rank 1's worker), a real client, and nothing left behind.

One server start (the zoo MiniMax-M3 pair, EAGLE3 k=3, float64): a completion equals in-process
``LLM.generate`` on one rank token for token, ``/metrics`` counts the drafts one rank makes, and after
SIGTERM the server exits 0 and every process it started (engine process, tensor-parallel worker,
multiprocessing's resource tracker) is gone.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from live_server import MEMORY, parse_metrics, start_cli_server
from specdec import LLM, SamplingParams
from specdec.zoo import zoo_path

PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 16


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis.
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_serve_with_two_ranks_answers_like_one_and_leaves_no_process_behind():
    model, draft = str(zoo_path("minimax-m3-tiny")), str(zoo_path("minimax-m3-tiny-eagle3"))
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 3}
    proc, base = start_cli_server(model, "--speculative-config", json.dumps(spec), "--tensor-parallel-size", "2",
                                  "--dtype", "float64", "--kv-cache-memory", MEMORY)
    try:
        started = descendants(proc.pid)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in started]
        # The engine process and, below it, rank 1's worker (both spawned), plus the resource tracker.
        assert sum(b"spawn_main" in c for c in commands) == 2, commands
        body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        got = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
        metrics = parse_metrics(httpx.get(f"{base}/metrics").text)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        stderr = proc.stderr.read()
    assert code == 0 and "Traceback" not in stderr, stderr[-2000:]
    deadline = time.monotonic() + 15
    while any(running(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in started if running(pid)] == []

    reference = LLM(model, speculative_config=spec, dtype="float64", kv_cache_memory=64 << 20)
    want = reference.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert got["choices"][0]["text"] == want.text
    assert got["usage"]["completion_tokens"] == len(want.token_ids) == MAX_TOKENS
    # The two ranks drafted as one does: the same drafts, the same tokens (a request's last drafts are
    # cut to the tokens it may still emit, so that is not 3 times the drafts).
    stats = reference.spec_stats()
    assert metrics["vllm:spec_decode_num_drafts_total"] == stats.num_drafts > 0
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
