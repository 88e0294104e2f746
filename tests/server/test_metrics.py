"""``/metrics``' counters of the engine's running totals advance by what they grew, warnings included."""

from __future__ import annotations

from specdec.server.engine_core import EngineSnapshot
from specdec.server.metrics import ServerMetrics


def test_engine_totals_become_counters():
    metrics = ServerMetrics("m", num_speculative_tokens=3)
    for warnings in (1, 1, 2):  # a load-time warning, then an acceptance alarm
        metrics.observe(EngineSnapshot(running=1, waiting=0, kv_usage=0.5, num_preemptions=0, prefix_cache_queries=8,
                                       prefix_cache_hits=4, spec_decode_warnings=warnings))
    text = metrics.exposition().decode()
    assert 'specdec:spec_decode_warnings_total{model_name="m"} 2.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 4.0' in text
