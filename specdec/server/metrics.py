"""The server's Prometheus metrics (vLLM's names) and its periodic stats log line.

Counters follow vLLM's definitions (shared/reference/FACTS.md section 1). The speculative ones are
counted per request and step from the engine's :class:`~specdec.outputs.StepOutput`, so after a run
they equal the sums of the per-request figures the responses carry; the engine's own totals
(preemptions, prefix-cache queries and hits, in tokens) follow its
:class:`~specdec.server.engine_core.EngineSnapshot`. While the engine is busy, every ``interval``
seconds one line gives the interval's throughput and acceptance, in the form the seeds quote::

    SpecDecoding metrics: Mean acceptance length: 2.83, Accepted throughput: 51.2 tokens/s, Drafted
    throughput: 81.0 tokens/s, Accepted: 256 tokens, Drafted: 405 tokens, Per-position acceptance rate:
    0.800, 0.602, 0.429, Avg Draft acceptance rate: 61.0%
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest

from specdec.outputs import StepOutput
from specdec.server.engine_core import EngineSnapshot

log = logging.getLogger("specdec.server")


class ServerMetrics:
    """The ``/metrics`` registry, updated after every step from what the engine reported (its
    :class:`~specdec.outputs.StepOutput` and an :class:`~specdec.server.engine_core.EngineSnapshot`)."""

    def __init__(self, model_name: str, num_speculative_tokens: int, interval: float = 5.0):
        disable_created_metrics()  # vLLM exposes no *_created series; neither do we
        self.registry = CollectorRegistry()
        name = model_name

        def counter(metric: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(metric, doc, labelnames=["model_name", *labels], registry=self.registry)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Steps in which a request had drafts.").labels(name)
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.").labels(name)
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(name)
        per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at each position.",
                          labels=("position",))
        self.accepted_per_pos = [per_pos.labels(name, str(i)) for i in range(num_speculative_tokens)]
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens computed.").labels(name)
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.").labels(name)
        self.step_errors = counter("specdec:engine_step_errors", "Engine steps that raised.").labels(name)
        # The engine's own running totals (EngineSnapshot fields), advanced by what they grew.
        self._totals = {
            "num_preemptions": counter("vllm:num_preemptions", "Requests preempted (recomputed later).").labels(name),
            "prefix_cache_queries": counter("vllm:prefix_cache_queries",
                                            "Tokens of admitted requests looked up in the prefix cache.").labels(name),
            "prefix_cache_hits": counter("vllm:prefix_cache_hits",
                                         "Tokens of admitted requests found in the prefix cache.").labels(name),
            # The lines themselves are in the engine's log (logger "specdec").
            "spec_decode_warnings": counter("specdec:spec_decode_warnings",
                                            "Warnings about speculation: a draft that does not fit its target at "
                                            "load, acceptance collapsed for the draft or one request.").labels(name),
        }
        self._seen = dict.fromkeys(self._totals, 0)
        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(metric, doc, labelnames=["model_name"], registry=self.registry).labels(name)

        self.running = gauge("vllm:num_requests_running", "Requests holding KV pages.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests queued.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Share of KV cache bytes in use (0..1).")
        self.interval = interval
        self._window = _Window(num_speculative_tokens)
        self._logged_at = self._last_step = time.monotonic()

    def on_step(self, out: StepOutput, snapshot: EngineSnapshot, seconds: float) -> None:
        now = time.monotonic()
        if now - self._last_step > self.interval:  # busy again after idling: a fresh window
            self._logged_at, self._window = now - seconds, _Window(len(self.accepted_per_pos))
        self._last_step = now
        window = self._window
        for part in out.requests:
            self.generation_tokens.inc(len(part.new_token_ids))
            window.generated += len(part.new_token_ids)
            if not part.draft_token_ids:
                continue
            self.drafts.inc()
            self.draft_tokens.inc(len(part.draft_token_ids))
            self.accepted.inc(part.num_accepted)
            window.add(len(part.draft_token_ids), part.num_accepted)
            for i in range(part.num_accepted):
                self.accepted_per_pos[i].inc()
        self.observe(snapshot)
        if now - self._logged_at >= self.interval:
            self._log(now - self._logged_at, snapshot)
            self._logged_at = now
            self._window = _Window(len(self.accepted_per_pos))

    def observe(self, snapshot: EngineSnapshot) -> None:
        """Set the gauges, and the counters of the engine's totals, from its latest figures."""
        self.running.set(snapshot.running)
        self.waiting.set(snapshot.waiting)
        self.kv_usage.set(snapshot.kv_usage)
        for field, metric in self._totals.items():
            total = getattr(snapshot, field)
            metric.inc(total - self._seen[field])
            self._seen[field] = total

    def on_admitted(self, num_prompt_tokens: int, snapshot: EngineSnapshot) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.observe(snapshot)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def _log(self, seconds: float, snapshot: EngineSnapshot) -> None:
        w = self._window
        queries = snapshot.prefix_cache_queries
        hit_rate = snapshot.prefix_cache_hits / queries if queries else 0.0
        log.info("Avg generation throughput: %.1f tokens/s, Running: %d reqs, Waiting: %d reqs, "
                 "KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%", w.generated / seconds, snapshot.running,
                 snapshot.waiting, 100 * snapshot.kv_usage, 100 * hit_rate)
        if w.drafts:
            rates = ", ".join(f"{a / w.drafts:.3f}" for a in w.per_position)
            log.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.1f tokens/s, "
                     "Drafted throughput: %.1f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                     "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                     1 + w.accepted / w.drafts, w.accepted / seconds, w.drafted / seconds, w.accepted, w.drafted,
                     rates, 100 * w.accepted / max(w.drafted, 1))


class _Window:
    """Counts since the last log line."""

    def __init__(self, k: int):
        self.drafts = self.drafted = self.accepted = self.generated = 0
        self.per_position = [0] * k

    def add(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.drafted += drafted
        self.accepted += accepted
        for i in range(accepted):
            self.per_position[i] += 1
