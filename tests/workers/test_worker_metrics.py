"""WorkerMetrics turns the engine's running totals into Prometheus counters: the
detokenizer fallbacks counter follows the engine's total across load reports."""

from __future__ import annotations

from prometheus_client import generate_latest

from services.common.metrics import WorkerMetrics


def _stats(fallbacks: int) -> dict:
    return {
        "num_running": 1,
        "num_waiting": 0,
        "num_free_blocks": 10,
        "num_total_blocks": 16,
        "detokenizer_fallbacks": fallbacks,
    }


def test_detokenizer_fallbacks_follow_the_engine_total():
    metrics = WorkerMetrics("decode", "m")
    for total in (0, 2, 2, 5):  # load reports as the engine's total grows
        metrics.update_load(_stats(total))
    text = generate_latest(metrics.registry).decode()
    assert "pdserve_detokenizer_fallbacks_total 5.0" in text
    assert "pdserve_free_kv_blocks 10.0" in text
