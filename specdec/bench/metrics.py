"""One benchmark run's records and vLLM ``benchmark_serving``'s metrics over them."""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np

# The metrics the table shows, with the spec run's relative change against the baseline.
DELTA_KEYS: tuple[str, ...] = (
    "request_throughput",
    "total_token_throughput",
    "output_throughput",
    "median_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
)


@attrs.define
class RequestRecord:
    """One request's arrival and emissions (``(time, tokens)``, one per step that gave it tokens)."""

    prompt_len: int
    arrival: float
    emissions: list[tuple[float, int]] = attrs.Factory(list)

    @property
    def output_len(self) -> int:
        return sum(n for _, n in self.emissions)

    @property
    def ttft(self) -> float:
        return self.emissions[0][0] - self.arrival

    @property
    def e2el(self) -> float:
        return self.emissions[-1][0] - self.arrival

    @property
    def itls(self) -> list[float]:
        times = [t for t, _ in self.emissions]
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        n = self.output_len
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None

    def as_dict(self, origin: float = 0.0) -> dict[str, Any]:
        """JSON-ready; ``arrival_s`` counts from ``origin`` (the run's start)."""
        return {
            "arrival_s": self.arrival - origin,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "ttft_ms": self.ttft * 1e3,
            "e2el_ms": self.e2el * 1e3,
            "tpot_ms": None if self.tpot is None else self.tpot * 1e3,
            "itl_ms": [x * 1e3 for x in self.itls],
            "tokens_per_emission": [n for _, n in self.emissions],
        }


def _stats(name: str, seconds: Sequence[float]) -> dict[str, float]:
    # vLLM reports 0 for a metric with no samples (e.g. ITL when every request emits once).
    ms = np.asarray(seconds, dtype=np.float64) * 1e3 if len(seconds) else np.zeros(1)
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """vLLM benchmark_serving's metrics for one run (times in ms, throughputs per second)."""
    inputs = sum(r.prompt_len for r in records)
    outputs = sum(r.output_len for r in records)
    return {
        "completed": len(records),
        "duration_s": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(records) / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
        **_stats("ttft", [r.ttft for r in records]),
        **_stats("tpot", [r.tpot for r in records if r.tpot is not None]),
        **_stats("itl", [x for r in records for x in r.itls]),
        **_stats("e2el", [r.e2el for r in records]),
    }


def deltas(baseline: dict[str, Any], spec: dict[str, Any]) -> dict[str, float | None]:
    """The spec run's relative change per table metric: (spec - baseline) / baseline; None if baseline is 0."""
    return {k: (spec[k] - baseline[k]) / baseline[k] if baseline[k] else None for k in DELTA_KEYS}


def prefix_cache_figures(queries: int, hits: int) -> dict[str, Any]:
    """A run's prefix-cache figures: tokens of admitted requests looked up (``queries``), found cached
    (``hits``), and ``hit_rate`` (0 when nothing was looked up)."""
    return {"queries": int(queries), "hits": int(hits), "hit_rate": hits / queries if queries else 0.0}
