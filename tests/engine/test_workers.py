"""The engine's worker processes under ``torchrun``: the same script on every rank, ``LLM(...)``
returns on rank 0 only, and the outputs equal one process's (float64)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import specdec
from specdec.llm import LLM
from specdec.sampling.params import SamplingParams
from specdec.zoo import zoo_path

PROMPTS = [[1, 5, 9, 200], [4, 8, 15, 16, 23]]

SCRIPT = """
import json, sys
from specdec.llm import LLM
from specdec.sampling.params import SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float64", tensor_parallel_size=2)
    outputs = llm.generate({prompts}, SamplingParams(max_tokens=8, temperature=0))
    llm.close()
    with open(sys.argv[2], "w") as f:  # only rank 0 gets here: the other rank served inside LLM()
        json.dump([o.token_ids for o in outputs], f)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_ranks_serve_the_driver_and_match_one_process(tmp_path: Path):
    model = str(zoo_path("llama-tiny"))
    script, out = tmp_path / "run.py", tmp_path / "out.json"
    script.write_text(SCRIPT.format(prompts=PROMPTS))
    root = str(Path(specdec.__file__).resolve().parents[1])  # the script runs from tmp_path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), str(script), model, str(out)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    single = LLM(model, dtype="float64").generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    assert json.loads(out.read_text()) == [o.token_ids for o in single]
