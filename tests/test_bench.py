"""``specdec bench``: the metrics' definitions, their consistency on real runs, and one-line errors.

Runs use the session's tiny float64 llama with n-gram speculation: greedy float64 speculation is
lossless, and n-gram drafts depend only on each request's tokens, so the bench's acceptance
counters must equal those of a plain ``LLM.generate`` over the same prompts, whatever the
concurrency did to the batches. The zoo's llama-tiny (a real tokenizer) checks several temperatures
and the adaptive controller's choices; the workloads and prompt sources are
tests/test_bench_workloads.py's.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import attrs
import pytest

from specdec import LLM, SamplingParams
from specdec.bench import (DELTA_KEYS, BenchConfig, RequestRecord, format_table, load_prompts, load_workload, runner,
                           serve, summarize)
from specdec.bench.workload import HELD_OUT, SYNTHETIC
from specdec.cli import main
from specdec.zoo import zoo_path

NGRAM = "ngram:num_speculative_tokens=3,prompt_lookup_min=1,prompt_lookup_max=2"
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 5, 8, 10, 2


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


# ----------------------------------------------------------------------------- definitions
def test_metrics_follow_vllm_definitions():
    # Request a: arrives at 0, tokens at 1.0 (1), 1.5 (3 at once, a speculative step), 2.5 (1).
    # Request b: arrives at 0.5, one token at 2.0.
    a = RequestRecord(4, 0.0, [(1.0, 1), (1.5, 3), (2.5, 1)])
    b = RequestRecord(6, 0.5, [(2.0, 1)])
    assert (a.output_len, a.ttft, a.e2el, a.itls, a.tpot) == (5, 1.0, 2.5, [0.5, 1.0], pytest.approx(1.5 / 4))
    assert (b.ttft, b.itls, b.tpot) == (1.5, [], None)
    m = summarize([a, b], duration=2.5)
    assert m["request_throughput"] == pytest.approx(2 / 2.5)
    assert m["output_throughput"] == pytest.approx(6 / 2.5)
    assert m["total_token_throughput"] == pytest.approx(16 / 2.5)
    assert m["median_ttft_ms"] == pytest.approx(1250.0)
    # TPOT only over requests with more than one token; ITL one gap per emission (2 gaps, not 4).
    assert m["mean_tpot_ms"] == m["p99_tpot_ms"] == pytest.approx(375.0)
    assert m["mean_itl_ms"] == pytest.approx(750.0) and m["median_itl_ms"] == pytest.approx(750.0)
    assert m["p99_itl_ms"] == pytest.approx(500.0 + 0.99 * 500.0)
    assert m["mean_e2el_ms"] == pytest.approx((2500.0 + 1500.0) / 2)


# ----------------------------------------------------------------------------- a real run
def _bench_json(llama, *extra: str) -> dict:
    proc = subprocess.run(
        [
            # The default KV budget: it must hold CONCURRENCY requests in whole pages.
            sys.executable, "-m", "specdec.cli", "bench", "--model", llama, "--dtype", "float64",
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
            "--num-prompts", str(NUM_PROMPTS), "--concurrency", str(CONCURRENCY), "--warmup", "1",
            "--speculative-config", NGRAM, "--prompt-source", "synthetic", "--json", *extra,
        ],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def bench_json(llama):
    return _bench_json(llama)


def _check_run(run: dict) -> None:
    reqs = run["requests"]
    assert run["num_preemptions"] == 0  # the default KV budget holds CONCURRENCY whole requests
    assert run["completed"] == len(reqs) == NUM_PROMPTS
    assert run["total_output_tokens"] == sum(r["output_len"] for r in reqs) == NUM_PROMPTS * OUTPUT_LEN
    assert run["total_input_tokens"] == sum(r["prompt_len"] for r in reqs) == NUM_PROMPTS * INPUT_LEN
    duration = run["duration_s"]
    assert run["output_throughput"] * duration == pytest.approx(run["total_output_tokens"])
    total = run["total_input_tokens"] + run["total_output_tokens"]
    assert run["total_token_throughput"] * duration == pytest.approx(total)
    assert run["request_throughput"] * duration == pytest.approx(NUM_PROMPTS)
    for r in reqs:
        assert 0 < r["ttft_ms"] <= r["e2el_ms"]
        assert r["arrival_s"] * 1e3 + r["e2el_ms"] <= duration * 1e3 + 1e-6
        assert sum(r["tokens_per_emission"]) == r["output_len"] == OUTPUT_LEN
        assert len(r["itl_ms"]) == len(r["tokens_per_emission"]) - 1
        assert sum(r["itl_ms"]) == pytest.approx(r["e2el_ms"] - r["ttft_ms"])
        assert r["tpot_ms"] == pytest.approx((r["e2el_ms"] - r["ttft_ms"]) / (OUTPUT_LEN - 1))
    ttfts = sorted(r["ttft_ms"] for r in reqs)
    assert run["median_ttft_ms"] == pytest.approx(ttfts[len(ttfts) // 2])
    itls = [x for r in reqs for x in r["itl_ms"]]
    assert run["mean_itl_ms"] == pytest.approx(sum(itls) / len(itls))
    assert run["mean_tpot_ms"] == pytest.approx(sum(r["tpot_ms"] for r in reqs) / len(reqs))
    # The first CONCURRENCY requests really run together: prefilled in one step, first tokens at one instant.
    firsts = [r["arrival_s"] * 1e3 + r["ttft_ms"] for r in reqs[:CONCURRENCY]]
    assert max(firsts) - min(firsts) == pytest.approx(0.0, abs=1e-6)
    # Never more than CONCURRENCY in flight, and a waiting request enters only when one has finished.
    spans = sorted((r["arrival_s"], r["arrival_s"] + r["e2el_ms"] / 1e3) for r in reqs)
    for i, (arrival, _end) in enumerate(spans):
        assert sum(1 for a, e in spans if a <= arrival < e) <= CONCURRENCY
        if i >= CONCURRENCY:
            assert sum(1 for _a, e in spans[:i] if e <= arrival) >= i - CONCURRENCY + 1


def test_json_fields_are_consistent(bench_json):
    result = bench_json
    assert set(result) == {"settings", "baseline", "speculative", "deltas", "identical_outputs", "runs"}
    # One temperature (greedy): its entry in runs is what the top level shows.
    assert result["runs"] == [{"temperature": 0.0, **{k: result[k] for k in ("baseline", "speculative", "deltas",
                                                                                "identical_outputs")}}]
    base, spec = result["baseline"], result["speculative"]
    _check_run(base)
    _check_run(spec)
    assert base["spec_stats"] is None
    assert all(r["tokens_per_emission"] == [1] * OUTPUT_LEN for r in base["requests"])
    assert result["identical_outputs"] == NUM_PROMPTS  # greedy float64: lossless
    for key in DELTA_KEYS:
        assert result["deltas"][key] == pytest.approx((spec[key] - base[key]) / base[key])
    settings = result["settings"]
    assert settings["speculative_config"]["method"] == "ngram" and settings["num_prompts"] == NUM_PROMPTS
    assert settings["tensor_parallel_size"] == 1
    assert settings["prompt_source"] == SYNTHETIC and settings["temperature"] == [0.0]


def test_identical_outputs_line_says_why_a_low_precision_run_may_differ(bench_json):
    """Without --batch-invariant a bf16 or float32 run's line says why its outputs may differ from the
    baseline's; with it, that they cannot. A float64 run's line says neither."""
    def line(result):
        return next(x for x in format_table(result).splitlines() if x.startswith("outputs identical"))

    assert bench_json["settings"]["batch_invariant"] is False
    assert line(bench_json) == f"outputs identical to the baseline: {NUM_PROMPTS}/{NUM_PROMPTS}"
    half = copy.deepcopy(bench_json)
    half["settings"]["dtype"] = "bfloat16"
    assert "rounding depends on the rows batched with it" in line(half) and "--batch-invariant makes them" in line(half)
    half["settings"]["batch_invariant"] = True
    assert line(half).endswith("(batch-invariant: each row computed independently of its batch)")


@pytest.mark.slow
def test_two_ranks_count_what_one_counts(bench_json, llama):
    # Each run's LLM stops its worker before the next run starts its own (one group per process).
    two = _bench_json(llama, "--tensor-parallel-size", "2")
    assert two["settings"]["tensor_parallel_size"] == 2
    assert two["identical_outputs"] == NUM_PROMPTS
    for run in ("baseline", "speculative"):
        _check_run(two[run])
    # Greedy float64 on two ranks emits the same tokens, so n-gram drafts and acceptance are the same.
    assert two["speculative"]["spec_stats"] == bench_json["speculative"]["spec_stats"]


def test_acceptance_matches_spec_stats(bench_json, llama):
    stats = bench_json["speculative"]["spec_stats"]
    assert stats["num_drafts"] > 0
    per_position = [a / stats["num_drafts"] for a in stats["accepted_per_position"]]
    assert stats["acceptance_per_position"] == pytest.approx(per_position)
    # Every emission is one step: one token plus the drafts it accepted.
    emissions = sum(len(r["tokens_per_emission"]) for r in bench_json["speculative"]["requests"])
    assert emissions + stats["num_accepted_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    # Without adaptive every request that may draft is given its cap (k, less only near its last token);
    # n-gram proposes at most that many.
    histogram = stats["num_drafts_histogram"]
    assert len(histogram) == 4 and histogram[3] > 0 and sum(histogram[1:]) >= stats["num_drafts"]
    assert sum(histogram) <= emissions
    # The same prompts through LLM.generate (all at once, no warm-up) count the same drafts.
    config = BenchConfig(model=llama, num_prompts=NUM_PROMPTS, input_len=INPUT_LEN, output_len=OUTPUT_LEN,
                         prompt_source="synthetic")
    llm = LLM(llama, speculative_config=NGRAM, dtype="float64", kv_cache_memory=4 << 20)
    llm.generate(load_prompts(config), SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True), use_tqdm=False)
    assert llm.spec_stats().as_dict() == stats


def test_table_and_dataset(llama, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    text, ids = json.dumps({"prompt": "def hello ( x ) :"}), json.dumps({"prompt_token_ids": [5, 6, 7]})
    data.write_text(f"{text}\n\n{ids}\n")  # a blank line is skipped
    common = ["bench", "--model", llama, "--dtype", "float64", "--kv-cache-memory", "4M", "--output-len", "4",
              "--dataset", str(data), "--warmup", "0"]
    capsys.readouterr()
    assert main([*common, "--speculative-config", NGRAM]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("Spec "))
    rows = [line.split() for line in lines if line.startswith(("no ", "ngram "))]
    assert header.split()[1] == "T" and [r[:2] for r in rows] == [["no", "0"], ["ngram", "k=3"]] and rows[1][2] == "0"
    for column in ("Req/s", "Total tok/s", "Output tok/s", "median TTFT (ms)", "TPOT mean/med/p99 (ms)",
                   "ITL mean/med/p99 (ms)", "delta", "mean TTFT (ms)", "prefix cache hits/queries"):
        assert column in header
    acceptance = next(line for line in lines if line.startswith("acceptance per position: "))
    assert "mean acceptance length" in acceptance and "; k chosen: 0:" in acceptance
    assert "outputs identical to the baseline: 2/2" in lines

    assert main([*common, "--num-prompts", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # The text prompt went through the model's tokenizer (which adds <s>); only its first line was kept.
    assert [r["prompt_len"] for r in result["baseline"]["requests"]] == [7]
    assert result["speculative"] is None and result["deltas"] is None


def _check_error(code: int, stderr: str, needle: str) -> None:
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    "args, lines, needle",
    [
        (["--concurrency", "0"], None, "concurrency (--concurrency) must be an int >= 1"),
        (["--output-len", "x"], None, "--output-len"),
        (["--speculative-config", "warp:k=3"], None, "warp"),
        (["--input-len", "200", "--output-len", "100"], None, "max_position_embeddings (256)"),
        (["--dataset", "{missing}"], None, "does not exist"),
        (["--dataset", "{data}"], ['{"prompt": "x"}', "not json"], ":2: not valid JSON"),
        (["--dataset", "{data}"], ['{"text": "x"}'], 'exactly one of "prompt"'),
        (["--dataset", "{data}"], ['{"prompt_token_ids": [1, -2]}'], "prompt_token_ids"),
        (["--dataset", "{data}", "--num-prompts", "3"], ['{"prompt_token_ids": [1]}'], "lower --num-prompts"),
        (["--dataset", "{data}"], ['{"prompt_token_ids": [1, 999]}'], "vocabulary"),
        (["--kv-cache-memory", "2K"], None, "kv_cache_memory"),
        (["--workload", "chat"], None, "workload (--workload) must be one of 'single', 'shared-prefix'"),
        (["--workload", "multi-turn", "--num-turns", "1"], None, "num_turns (--num-turns) must be an int >= 2"),
        (["--workload", "shared-prefix", "--dataset", "{data}"], ['{"prompt": "x"}'], "draws its own"),
        (["--temperature", "abc"], None, "argument --temperature: expected a temperature or a comma list"),
        (["--temperature", "0,"], None, "argument --temperature: expected"),
        (["--temperature", "0,-0.5"], None, "temperature (--temperature) must be numbers >= 0"),
        (["--temperature", "0.7,0.7"], None, "each once"),
        (["--temperature", "nan"], None, "temperature (--temperature) must be numbers >= 0"),
        (["--prompt-source", "web"], None, "prompt_source (--prompt-source) must be one of 'held-out', 'synthetic'"),
        (["--prompt-source", "synthetic", "--dataset", "{data}"], ['{"prompt": "x"}'], "give one"),
        (["--output-spread", "1"], None, "output_spread (--output-spread) must be a number in [0, 1)"),
    ],
)
def test_errors_are_one_line_with_exit_2(args, lines, needle, llama, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    if lines is not None:
        data.write_text("\n".join(lines) + "\n")
    args = [a.replace("{data}", str(data)).replace("{missing}", str(tmp_path / "none.jsonl")) for a in args]
    command = ["bench", "--model", llama, "--input-len", "4", "--output-len", "4"]
    if "--dataset" not in args:
        command += ["--num-prompts", "1"]
    capsys.readouterr()  # drop what building the checkpoint printed
    code = main(command + args)
    _check_error(code, capsys.readouterr().err, needle)


def test_text_prompts_need_a_tokenizer(tiny_checkpoint, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hello"}\n')
    model = str(tiny_checkpoint("llama_draft"))
    capsys.readouterr()  # drop what building the checkpoint printed
    code = main(["bench", "--model", model, "--dataset", str(data)])
    _check_error(code, capsys.readouterr().err, "no tokenizer")
    code = main(["bench", "--model", model, "--prompt-source", "held-out"])
    _check_error(code, capsys.readouterr().err, "no tokenizer; use --prompt-source synthetic")
    # Without a tokenizer the default falls back to synthetic ids, and says so.
    w = load_workload(BenchConfig(model=model, num_prompts=2, input_len=4, warmup=0))
    assert w.source.startswith("synthetic token ids") and "no tokenizer" in w.source


ZOO_LLAMA = str(zoo_path("llama-tiny"))  # real tokenizer: the default prompts are held-out text


# ----------------------------------------------------------------------------- temperatures and the adaptive controller
ADAPTIVE = f"eagle3:model={zoo_path('llama-tiny-eagle3')},num_speculative_tokens=3,adaptive=true"


def test_each_temperature_gets_its_rows_and_the_drafts_chosen_are_shown(monkeypatch, capsys):
    used = []

    def spy(engine, prompts, params, *args, **kwargs):
        used.append((params if isinstance(params, SamplingParams) else params[0]).temperature)
        return serve(engine, prompts, params, *args, **kwargs)

    monkeypatch.setattr(runner, "serve", spy)
    n, output_len = 3, 6
    capsys.readouterr()
    assert main(["bench", "--model", ZOO_LLAMA, "--dtype", "float64", "--kv-cache-memory", "4M",
                 "--num-prompts", str(n), "--input-len", "32", "--output-len", str(output_len), "--concurrency", "2",
                 "--warmup", "1", "--speculative-config", ADAPTIVE, "--temperature", "0,0.7", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # Baseline then spec run at each temperature, each a warm-up then the run, every run its own engine.
    assert used == [0.0] * 4 + [0.7] * 4
    settings = result["settings"]
    assert settings["temperature"] == [0.0, 0.7] and settings["prompt_source"] == HELD_OUT
    assert settings["speculative_config"]["adaptive"] is True
    runs = result["runs"]
    assert [r["temperature"] for r in runs] == [0.0, 0.7]
    assert all(result[k] == runs[0][k] for k in ("baseline", "speculative", "deltas", "identical_outputs"))
    assert runs[0]["identical_outputs"] == n  # greedy float64: lossless, whatever the controller chose
    for entry in runs:
        for run in (entry["baseline"], entry["speculative"]):
            assert run["completed"] == n and run["total_output_tokens"] == n * output_len
        spec = entry["speculative"]
        stats = spec["spec_stats"]
        histogram = stats["num_drafts_histogram"]
        # The controller's choices, 0..k, per (request, step) that could draft; a proposer drafts at most that.
        assert len(histogram) == 4 and sum(histogram) > 0
        assert sum(histogram[1:]) >= stats["num_drafts"]
        assert sum(j * c for j, c in enumerate(histogram)) >= stats["num_draft_tokens"]
        assert sum(histogram) <= sum(len(r["tokens_per_emission"]) for r in spec["requests"])
    table = format_table(result).splitlines()
    rows = [line.split() for line in table if line.startswith(("no ", "eagle3 "))]
    assert [(r[0], r[1] if r[0] == "no" else r[3]) for r in rows] == [  # label and temperature
        ("no", "0"), ("eagle3", "0"), ("no", "0.7"), ("eagle3", "0.7")]
    assert all(" ".join(r[:3]) == "eagle3 adaptive k<=3" for r in rows if r[0] == "eagle3")
    for t, entry in zip(("0", "0.7"), runs):
        histogram = entry["speculative"]["spec_stats"]["num_drafts_histogram"]
        shares = " ".join(f"{j}:{c / sum(histogram) * 100:.0f}%" for j, c in enumerate(histogram))
        line = next(x for x in table if x.startswith(f"T={t}: acceptance per position: "))
        assert line.endswith(f"; k chosen: {shares}")
        if entry["speculative"]["spec_stats"]["num_drafts"]:  # drafts drawn from q at T=0.7: rejection sampling
            assert f"; verifier: {'greedy' if t == '0' else 'rejection'};" in line
    assert f"T=0: outputs identical to the baseline: {n}/{n}" in table
    assert any(x.startswith(f"T=0.7: outputs identical to the baseline: ") and "sampled" in x for x in table)


def test_output_spread_draws_each_request_s_length_once_for_every_run(llama):
    config = BenchConfig(model=llama, dtype="float64", num_prompts=6, input_len=4, output_len=8, output_spread=0.5,
                         prompt_source="synthetic", speculative_config=NGRAM, concurrency=2, warmup=1)
    lens = load_workload(config).output_lens
    assert lens == load_workload(config).output_lens  # drawn with the seed
    assert all(4 <= n <= 12 for n in lens) and len(set(lens)) > 1
    assert load_workload(attrs.evolve(config, output_spread=0.0)).output_lens == [8] * 6
    result = runner.run_benchmark(config)
    for run in (result["baseline"], result["speculative"]):  # requests in prompt order
        assert [r["output_len"] for r in run["requests"]] == lens
        assert run["total_output_tokens"] == sum(lens)
    assert result["identical_outputs"] == 6  # greedy float64
    assert result["settings"]["output_spread"] == 0.5
    assert "4/8±4" in format_table(result)


def test_serve_takes_one_sampling_params_per_prompt_and_keeps_the_concurrency(llama):
    """``runner.serve`` with per-prompt parameters (benchmarks/bench_adaptive.py draws output lengths):
    each request runs to its own length, and no more than ``concurrency`` are ever in flight."""
    engine = LLM(llama, dtype="float32", max_num_seqs=8, kv_cache_memory=1 << 22).engine
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 7, 1, 5)]
    running, step = [], engine.step

    def counting_step():
        running.append(len(engine.running_ids()))
        return step()

    engine.step = counting_step
    records, _, _, outputs = runner.serve(engine, prompts, params, concurrency=2)
    assert [len(o) for o in outputs] == [3, 7, 1, 5]
    assert len(records) == 4 and max(running) == 2
