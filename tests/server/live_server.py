"""Real servers for the server tests: uvicorn on 127.0.0.1 (in a thread of the test process, so a test
can look inside the engine, or as a ``specdec serve`` subprocess for the command line and signals).

The models are the zoo's, in float64 so that greedy outputs over HTTP can be compared with in-process
``LLM.generate`` token for token whatever batches the server formed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

from specdec.zoo import zoo_path

MEMORY = "64M"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no healthy server at {base} after {timeout} s")


class LiveServer:
    """``specdec serve`` arguments -> uvicorn serving them in a thread of this process, over an engine
    process as ``specdec serve`` runs it, or (``in_thread``) an engine thread a test can look inside."""

    def __init__(self, *argv: str, in_thread: bool = False):
        import uvicorn

        from specdec.cli import _Parser
        from specdec.server.api import create_app
        from specdec.server.args import build_parser, parse_server_args
        from specdec.server.launch import Server

        self.port = free_port()
        args, self.warnings = parse_server_args(build_parser(_Parser(prog="specdec serve")),
                                                [*argv, "--port", str(self.port), "--stats-interval", "1",
                                                 *(["--no-engine-process"] if in_thread else [])])
        self.server = Server(args)
        config = uvicorn.Config(create_app(self.server), host="127.0.0.1", port=self.port, log_level="warning")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        wait_healthy(self.base)
        return self

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=60)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.base}/metrics").text)

    def settled(self, timeout: float = 60.0) -> dict[str, float]:
        """The metrics once nothing runs or waits and the KV cache is empty (fails after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"]) == (
                    0, 0, 0):
                return m
            time.sleep(0.05)
        raise AssertionError(f"the server did not settle: {self.metrics()}")


def parse_metrics(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, with the model_name label dropped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        if "{" in key:
            name, labels = key[:-1].split("{", 1)
            kept = [x for x in labels.split(",") if not x.startswith("model_name=")]
            key = name + ("{" + ",".join(kept) + "}" if kept else "")
        out[key] = float(value)
    return out


def start_cli_server(*argv: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m specdec.cli serve ...`` on a free port; returns the process (stderr piped) and base URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", *argv, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc=proc)
    except BaseException:
        proc.kill()
        raise
    return proc, base


def eagle3_spec() -> str:
    return json.dumps({"method": "eagle3", "model": str(zoo_path("llama-tiny-eagle3")), "num_speculative_tokens": 3})
