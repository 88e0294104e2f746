"""Third-party proposers: registered in the process, or installed as a separate distribution with an
entry point, and then selected by name like a built-in through ``LLM``, ``specdec generate`` and
``specdec bench``, with the built-ins' validation. The plug-in is ``examples/custom_proposer.py``.

The distribution is built and installed for real (pip, setuptools, into a folder of its own that is
put on the path), so what is tested is what a user's ``pip install`` gives: a ``*.dist-info`` with an
``entry_points.txt`` that ``importlib.metadata`` finds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import LLM, SamplingParams
from specdec.proposers import register_proposer
from specdec.proposers.config import parse_speculative_config
from specdec.proposers.registry import PROPOSERS, available_proposers

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_proposer.py"
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 7, 7], [40, 41, 42, 40, 41]]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
MEMORY = 4 << 20


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def plain(llama):
    llm = LLM(llama, dtype="float64", kv_cache_memory=MEMORY)
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example packaged as distribution ``specdec-bigram``, entry point ``bigram-ep``, pip-installed
    into a folder of its own; returns that folder."""
    source = tmp_path_factory.mktemp("bigram_src")
    (source / "specdec_bigram.py").write_text(EXAMPLE.read_text())
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "specdec-bigram"\nversion = "0.1"\n\n'
        '[project.entry-points."specdec.proposers"]\nbigram-ep = "specdec_bigram:BigramProposer"\n\n'
        '[tool.setuptools]\npy-modules = ["specdec_bigram"]\n'
    )
    site = tmp_path_factory.mktemp("bigram_site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
         "--target", str(site), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    assert list(site.glob("specdec_bigram-0.1.dist-info/entry_points.txt"))
    return site


@pytest.fixture
def on_path(installed, monkeypatch):
    monkeypatch.syspath_prepend(str(installed))
    PROPOSERS.refresh()
    yield installed
    monkeypatch.undo()
    PROPOSERS.refresh()


def _example_class():
    import importlib.util

    spec = importlib.util.spec_from_file_location("custom_proposer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BigramProposer


def test_a_registered_proposer_is_a_method_like_the_built_ins(llama, plain):
    register_proposer("bigram-test", _example_class())
    assert "bigram-test" in available_proposers()
    cfg = parse_speculative_config("bigram-test:num_speculative_tokens=3,min_count=2")
    assert (cfg.method, cfg.num_speculative_tokens, cfg.min_count) == ("bigram-test", 3, 2)
    assert parse_speculative_config(cfg.to_string()) == cfg == parse_speculative_config(cfg.to_dict())
    # The engine's keys come with every method, a plug-in's too (its factory never sees them).
    assert parse_speculative_config("bigram-test:num_speculative_tokens=3,adaptive=true").adaptive is True
    llm = LLM(llama, dtype="float64", kv_cache_memory=MEMORY, speculative_config=cfg)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == plain
    assert llm.spec_stats().num_accepted_tokens > 0


@pytest.mark.parametrize(
    "value, needles",
    [
        ("bigram-test:num_speculative_tokens=3,window=4",
         ["unknown key 'window' for method 'bigram-test'", "valid keys: num_speculative_tokens, min_count"]),
        ("bigram-test:num_speculative_tokens=3,min_count=two", ["min_count must be an int"]),
        ({"method": "bigram-test", "num_speculative_tokens": 3, "min_count": 1.5}, ["min_count must be an int"]),
        ("bigram-test:min_count=2", ["requires 'num_speculative_tokens'"]),
        ("bigram-test:num_speculative_tokens=0", ["num_speculative_tokens must be an int >= 1"]),
        ("bigram-tset:num_speculative_tokens=3", ["unknown method 'bigram-tset'", "bigram-test", "eagle3"]),
    ],
)
def test_a_plugin_is_validated_with_the_built_ins_errors(value, needles):
    register_proposer("bigram-test", _example_class())
    with pytest.raises(ValueError) as info:
        parse_speculative_config(value)
    message = str(info.value)
    assert "\n" not in message and message.startswith("speculative config: ")
    for needle in needles:
        assert needle in message


def test_an_installed_distribution_is_selected_by_name_in_llm(on_path, llama, plain):
    assert "bigram-ep" in available_proposers()
    llm = LLM(llama, dtype="float64", kv_cache_memory=MEMORY, speculative_config="bigram-ep:num_speculative_tokens=3")
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == plain
    assert type(llm.engine.proposer).__module__ == "specdec_bigram"  # the installed copy, not the example


def _cli(installed: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(installed), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_an_installed_distribution_is_selected_by_name_in_the_cli(installed, llama, plain):
    ids = ["--prompt-ids", "1,2,3,1,2,3,1,2", "--prompt-ids", "7,7,7,7", "--prompt-ids", "40,41,42,40,41"]
    common = ["--model", llama, "--dtype", "float64", "--kv-cache-memory", "4M"]
    proc = _cli(installed, "generate", *common, *ids, "--max-tokens", "12", "--ignore-eos", "--json",
                "--speculative-config", "bigram-ep:num_speculative_tokens=3,min_count=1")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [o["token_ids"] for o in result["outputs"]] == plain
    assert result["spec_stats"]["num_drafts"] > 0

    bad = _cli(installed, "generate", *common, *ids, "--speculative-config", "bigram-ep:num_speculative_tokens=3,k=2")
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "unknown key 'k' for method 'bigram-ep'" in lines[0]

    bench = _cli(installed, "bench", *common, "--input-len", "8", "--output-len", "8", "--num-prompts", "3",
                 "--concurrency", "2", "--speculative-config", "bigram-ep:num_speculative_tokens=3", "--json")
    assert bench.returncode == 0, bench.stderr
    report = json.loads(bench.stdout)
    assert report["settings"]["speculative_config"]["method"] == "bigram-ep"
    assert report["identical_outputs"] == 3  # greedy float64: lossless
