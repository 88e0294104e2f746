"""The seed-001 table of a benchmark result (plus mean TTFT and the prefix-cache hits), and progress lines
for a person watching."""

from __future__ import annotations

import sys
from typing import Any


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def _triple(run: dict[str, Any], name: str) -> str:
    return "/".join(f"{run[f'{s}_{name}_ms']:.2f}" for s in ("mean", "median", "p99"))


def _prefix_hits(run: dict[str, Any]) -> str:
    cache = run.get("prefix_cache")
    return "-" if cache is None else f"{cache['hits']}/{cache['queries']} ({cache['hit_rate'] * 100:.1f}%)"


def _length(n: float) -> str:
    n = round(n)
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def format_table(result: dict[str, Any]) -> str:
    """The seed 001 table (one row per run, deltas against the baseline) and the acceptance lines."""
    s = result["settings"]
    spec_cfg = s["speculative_config"]
    runs = [("no", result["baseline"], None)] if result["baseline"] is not None else []
    if result["speculative"] is not None:
        label = f"{spec_cfg['method']} k={spec_cfg['num_speculative_tokens']}"
        runs.append((label, result["speculative"], result["deltas"]))
    header = [
        "Spec", "ISL/OSL", "Conc", "Req/s", "delta", "Total tok/s", "delta", "Output tok/s", "delta",
        "median TTFT (ms)", "delta", "TPOT mean/med/p99 (ms)", "delta", "ITL mean/med/p99 (ms)", "delta",
        "mean TTFT (ms)", "prefix cache hits/queries",
    ]
    rows = [header]
    lengths = f"{_length(s['mean_input_len'])}/{_length(s['output_len'])}"
    for label, run, d in runs:
        d = d or {}
        rows.append([
            label, lengths, str(s["concurrency"]),
            f"{run['request_throughput']:.3f}", _pct(d.get("request_throughput")),
            f"{run['total_token_throughput']:.1f}", _pct(d.get("total_token_throughput")),
            f"{run['output_throughput']:.1f}", _pct(d.get("output_throughput")),
            f"{run['median_ttft_ms']:.1f}", _pct(d.get("median_ttft_ms")),
            _triple(run, "tpot"), _pct(d.get("mean_tpot_ms")),
            _triple(run, "itl"), _pct(d.get("mean_itl_ms")),
            f"{run['mean_ttft_ms']:.1f}", _prefix_hits(run),
        ])
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    where = f"server: {s['base_url']}  " if s.get("base_url") else ""
    source = s.get("prompt_source") or ("dataset " + s["dataset"] if s.get("dataset") else "synthetic")
    shape = f"{s['workload_description']} from " if s.get("workload_description") else ""
    tp = s.get("tensor_parallel_size", 1)
    ranks = f"tensor parallel: {tp}  " if tp not in (1, "(server's)") else ""
    lines = [
        f"{where}model: {s['model']}  backend: {s['attention_backend']}  dtype: {s['dtype']}  {ranks}"
        f"prompts: {s['num_prompts']} ({shape}{source})  warm-up: {s['warmup']}",
    ]
    for row in rows:  # the label left-aligned, numbers right-aligned
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    lines.append(
        "duration (s): " + ", ".join(f"{label} {run['duration_s']:.2f}" for label, run, _ in runs)
        + "; preemptions: " + ", ".join(f"{label} {run['num_preemptions']}" for label, run, _ in runs)
        + "; ITL counts one gap per emission (a speculative step emits several tokens at once), as vLLM does"
    )
    spec_run = result["speculative"]
    if spec_run is not None:
        st = spec_run["spec_stats"]
        per_position = ", ".join(f"{a:.3f}" for a in st["acceptance_per_position"])
        lines.append(
            f"acceptance per position: {per_position}; draft acceptance rate {st['draft_acceptance_rate'] * 100:.1f}%; "
            f"mean acceptance length {st['mean_acceptance_length']:.2f} ({st['num_drafts']} drafts)"
        )
        if result["identical_outputs"] is not None:
            lines.append(f"outputs identical to the baseline: {result['identical_outputs']}/{s['num_prompts']}")
    return "\n".join(lines)


def progress_to_stderr(message: str) -> None:
    """Progress lines, only for a person watching (a terminal), so captured stderr stays clean."""
    if sys.stderr.isatty():
        print(f"bench: {message}", file=sys.stderr, flush=True)
