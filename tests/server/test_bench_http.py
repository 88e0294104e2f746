"""``specdec bench --base-url``: the serving benchmark over HTTP against live servers, with the same
definitions as the in-process one (and the same prompts), acceptance from the server's /metrics."""

from __future__ import annotations

import json

import pytest

from live_server import free_port
from specdec.bench import BenchConfig, load_workload
from specdec.cli import main


def test_bench_over_http_with_a_baseline_server(plain_server, spec_server, llama, capsys):
    common = ["bench", "--model", llama, "--num-prompts", "5", "--input-len", "12", "--output-len", "10",
              "--concurrency", "2", "--base-url", spec_server.base]
    before = spec_server.metrics()
    assert main([*common, "--baseline-url", plain_server.base, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    base, spec = result["baseline"], result["speculative"]
    assert result["identical_outputs"] == 5  # greedy float64 over HTTP: lossless
    assert result["settings"]["speculative_config"]["method"] == "eagle3"
    for run in (base, spec):
        assert run["completed"] == 5 and run["total_output_tokens"] == 50
        assert all(sum(r["tokens_per_emission"]) == 10 for r in run["requests"])
    assert all(r["tokens_per_emission"] == [1] * 10 for r in base["requests"])
    stats = spec["spec_stats"]
    emissions = sum(len(r["tokens_per_emission"]) for r in spec["requests"])
    assert emissions + stats["num_accepted_tokens"] == 50  # each chunk: one token plus the drafts it accepted
    after = spec_server.metrics()
    # The warm-up request is counted by the server but not by the run.
    assert 0 < stats["num_drafts"] < after["vllm:spec_decode_num_drafts_total"] - before["vllm:spec_decode_num_drafts_total"]
    assert main(common) == 0
    table = capsys.readouterr().out
    assert table.startswith(f"server: {spec_server.base}") and "acceptance per position: " in table
    # Drawn output lengths ask each request for its own max_tokens.
    assert main([*common, "--output-spread", "0.5", "--json"]) == 0
    spread = json.loads(capsys.readouterr().out)["speculative"]
    lens = load_workload(BenchConfig(model=llama, num_prompts=5, input_len=12, output_len=10,
                                     output_spread=0.5)).output_lens
    assert [r["output_len"] for r in spread["requests"]] == lens and len(set(lens)) > 1


def test_multi_turn_over_http_hits_the_servers_prefix_cache(plain_server, llama, capsys):
    before = plain_server.metrics()
    assert main(["bench", "--model", llama, "--base-url", plain_server.base, "--workload", "multi-turn",
                 "--num-prompts", "2", "--num-turns", "2", "--input-len", "16", "--output-len", "4",
                 "--concurrency", "2", "--warmup", "0", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["baseline"]
    after = plain_server.metrics()
    # Turn 2 is turn 1's 16-token message + its 4 tokens + a new message, and finds turn 1's full page.
    assert [r["prompt_len"] for r in run["requests"]] == [16, 36, 16, 36]
    grew = {k: after[f"vllm:prefix_cache_{k}_total"] - before[f"vllm:prefix_cache_{k}_total"]
            for k in ("queries", "hits")}
    assert run["prefix_cache"] == {**grew, "hit_rate": grew["hits"] / grew["queries"]}
    assert grew == {"queries": 104, "hits": 32}


@pytest.mark.parametrize("extra, needle", [
    (["--base-url", "http://127.0.0.1:{port}"], "no specdec server answers"),
    (["--baseline-url", "http://127.0.0.1:{port}"], "needs base_url"),
])
def test_over_http_errors_are_one_line(extra, needle, llama, capsys):
    port = free_port()
    argv = ["bench", "--model", llama, "--num-prompts", "1", *[a.format(port=port) for a in extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
