"""Two small local lm_eval tasks (a ``generate_until`` task with stop strings, a ``multiple_choice``
loglikelihood task) and running the ``lm_eval`` CLI against a server."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

GENERATE = [
    {"prompt": "def fibonacci(n):\n", "target": "    if n"},
    {"prompt": "import os\nimport sys\n\n\ndef main():\n", "target": "    pass"},
    {"prompt": "class Stack:\n", "target": "    def"},
    {"prompt": "    for i in range(len(items)):\n", "target": "        yield"},
]
CHOICE = [
    {"prompt": "import", "choices": [" os", " sys", " re"], "label": 0},
    {"prompt": "def main():\n   ", "choices": [" return", " pass", " print"], "label": 1},
    {"prompt": "class Stack:\n    def", "choices": [" __init__", " push", " pop"], "label": 0},
]


# Few-shot examples for the seeds' --num_fewshot (code starts and how they go on).
FEWSHOT = [{"prompt": f"def f{i}(x):\n", "target": f"    return x + {i}"} for i in range(24)]


def write_tasks(folder: Path) -> list[str]:
    """Two lm_eval task configs over local JSONL files; returns their names."""
    for name, rows in (("gen", GENERATE), ("choice", CHOICE), ("fewshot", FEWSHOT)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {file}\ntest_split: test\n"
    (folder / "gen.yaml").write_text(
        "task: specdec_gen\n"
        + f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        + f"    train: {folder / 'fewshot.jsonl'}\ntest_split: test\nfewshot_split: train\n"
        + 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        + 'generation_kwargs:\n  until: ["\\n\\n", "class "]\n  max_gen_toks: 24\n  do_sample: false\n'
        + "  temperature: 0\nmetric_list:\n  - metric: exact_match\n")
    (folder / "choice.yaml").write_text(
        "task: specdec_choice\n" + common.format(file=folder / "choice.jsonl")
        + 'output_type: multiple_choice\ndoc_to_text: "{{prompt}}"\ndoc_to_choice: "{{choices}}"\n'
        + 'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n')
    return ["specdec_gen", "specdec_choice"]


def lm_eval(model: str, base: str, tasks: list[str], include: Path, out: Path, extra: str = "",
            cli: tuple[str, ...] = ()) -> tuple[dict, dict[str, list]]:
    """Run the lm_eval CLI; returns the results and, per task, the samples' responses in document order."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = f"model={model},base_url={base}/v1/completions,num_concurrent=8,max_retries=3,tokenized_requests=False"
    proc = subprocess.run(
        ["lm_eval", "--model", "local-completions", "--model_args", args + extra, "--tasks", ",".join(tasks),
         "--include_path", str(include), "--log_samples", "--output_path", str(out), *cli],
        capture_output=True, text=True, env=env, timeout=600, cwd=out.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {}
    for task in tasks:
        lines = next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()
        docs = sorted((json.loads(line) for line in lines), key=lambda d: d["doc_id"])
        samples[task] = [(d["doc_id"], d["resps"], d["filtered_resps"]) for d in docs]
    return results, samples
