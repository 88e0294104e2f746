"""The seed-001 table of a benchmark result (plus a temperature column, mean TTFT, the prefix-cache
hits and the drafts chosen per step), and progress lines for a person watching."""

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


def _temperature(t: float | None) -> str:
    return "-" if t is None else f"{t:g}"


def _k_chosen(stats: dict[str, Any]) -> str | None:
    """``"k chosen: 0:12% 1:30% 2:28% 3:30%"``: the share of (request, step) pairs given each number of
    drafts (``num_drafts_histogram``); None when nothing was counted."""
    histogram = stats.get("num_drafts_histogram") or []
    total = sum(histogram)
    if not total:
        return None
    return "k chosen: " + " ".join(f"{j}:{count / total * 100:.0f}%" for j, count in enumerate(histogram))


def _by_temperature(result: dict[str, Any]) -> list[dict[str, Any]]:
    """``result["runs"]``; a result without them (one temperature, built by hand) as its one entry."""
    if result.get("runs"):
        return result["runs"]
    t = result["settings"].get("temperature")
    if isinstance(t, list):  # the top-level runs are the first temperature's
        t = t[0] if t else None
    return [{"temperature": t, **{k: result[k] for k in ("baseline", "speculative", "deltas", "identical_outputs")}}]


def format_table(result: dict[str, Any]) -> str:
    """The seed 001 table (per temperature, one row per run with deltas against that temperature's
    baseline), then per spec run the acceptance line (with the drafts chosen) and the outputs match."""
    s = result["settings"]
    spec_cfg = s["speculative_config"]
    entries = _by_temperature(result)
    several = len(entries) > 1
    spec_label = ""
    if spec_cfg is not None:
        k = spec_cfg["num_speculative_tokens"]
        method = spec_cfg["method"]
        spec_label = f"{method} adaptive k<={k}" if spec_cfg.get("adaptive") else f"{method} k={k}"
    runs = []  # (label, temperature, run, deltas)
    for entry in entries:
        if entry["baseline"] is not None:
            runs.append(("no", entry["temperature"], entry["baseline"], None))
        if entry["speculative"] is not None:
            runs.append((spec_label, entry["temperature"], entry["speculative"], entry["deltas"]))
    header = [
        "Spec", "T", "ISL/OSL", "Conc", "Req/s", "delta", "Total tok/s", "delta", "Output tok/s", "delta",
        "median TTFT (ms)", "delta", "TPOT mean/med/p99 (ms)", "delta", "ITL mean/med/p99 (ms)", "delta",
        "mean TTFT (ms)", "prefix cache hits/queries",
    ]
    rows = [header]
    spread = s.get("output_spread") or 0
    output = _length(s["output_len"]) + (f"±{round(s['output_len'] * spread)}" if spread else "")
    lengths = f"{_length(s['mean_input_len'])}/{output}"
    for label, t, run, d in runs:
        d = d or {}
        rows.append([
            label, _temperature(t), lengths, str(s["concurrency"]),
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
    named = [(f"{label} T={_temperature(t)}" if several else label, run) for label, t, run, _ in runs]
    lines.append(
        "duration (s): " + ", ".join(f"{label} {run['duration_s']:.2f}" for label, run in named)
        + "; preemptions: " + ", ".join(f"{label} {run['num_preemptions']}" for label, run in named)
        + "; ITL counts one gap per emission (a speculative step emits several tokens at once), as vLLM does"
    )
    for entry in entries:
        spec_run, t = entry["speculative"], entry["temperature"]
        if spec_run is None:
            continue
        at = f"T={_temperature(t)}: " if several else ""
        st = spec_run["spec_stats"]
        per_position = ", ".join(f"{a:.3f}" for a in st["acceptance_per_position"])
        chosen = _k_chosen(st)
        verifiers = sorted(st.get("num_drafts_by_verifier") or {})  # None over HTTP
        lines.append(
            f"{at}acceptance per position: {per_position}; "
            f"draft acceptance rate {st['draft_acceptance_rate'] * 100:.1f}%; "
            f"mean acceptance length {st['mean_acceptance_length']:.2f} ({st['num_drafts']} drafts)"
            + (f"; verifier: {', '.join(verifiers)}" if verifiers else "") + (f"; {chosen}" if chosen else "")
        )
        if entry["identical_outputs"] is not None:
            sampled = ""
            if t and "rejection" in verifiers:
                sampled = " (sampled, rejection sampling: the target's law, not plain sampling's tokens)"
            elif t and verifiers:
                sampled = " (sampled, deterministic drafts: the coupled verifier gives plain sampling's tokens)"
            elif t:  # nothing drafted, or over HTTP, where the verifiers are not counted
                sampled = " (sampled: plain sampling's tokens with deterministic drafts, the law with drafts from q)"
            lines.append(f"{at}outputs identical to the baseline: {entry['identical_outputs']}/{s['num_prompts']}"
                         f"{sampled}{_rounding_note(s, t, verifiers)}")
    return "\n".join(lines)


def _rounding_note(s: dict[str, Any], temperature: float, verifiers: list[str]) -> str:
    """Why greedy (or coupled) outputs may differ from the baseline's, or that the mode rules it out."""
    if s.get("batch_invariant") is True:
        return " (batch-invariant: each row computed independently of its batch)"
    if s.get("batch_invariant") is not False or s.get("dtype") == "float64" or (temperature and "rejection" in verifiers):
        return ""  # the server's setting, float64 (near-ties beyond its rounding), or sampled by law
    return ("; without --batch-invariant a row's rounding depends on the rows batched with it (a verify's k+1 "
            "rows, the other requests), so tokens can differ where two logits nearly tie; --batch-invariant "
            "makes them identical")


def progress_to_stderr(message: str) -> None:
    """Progress lines, only for a person watching (a terminal), so captured stderr stays clean."""
    if sys.stderr.isatty():
        print(f"bench: {message}", file=sys.stderr, flush=True)
