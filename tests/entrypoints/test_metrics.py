from __future__ import annotations

from deepinfer_core.entrypoints.metrics import Histogram, ServerMetrics


def test_histogram_buckets_are_cumulative() -> None:
    histogram = Histogram(buckets=(0.1, 1.0))
    for value in (0.05, 0.5, 0.7, 5.0):
        histogram.observe(value)
    assert histogram.lines("x") == ['x_bucket{le="0.1"} 1', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 4',
                                    "x_sum 6.25", "x_count 4"]


def test_render_reports_counters_and_engine_gauges() -> None:
    metrics = ServerMetrics()
    metrics.count_request("chat", "ok")
    metrics.count_request("chat", "ok")
    metrics.count_request("messages", "aborted")
    text = metrics.render({"num_running": 3, "num_waiting": 1, "prefix_cache_hit_tokens": 256,
                           "prefix_cache_queried_tokens": 1024})
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert samples['deepinfer_requests_total{api="chat",outcome="ok"}'] == "2"
    assert samples['deepinfer_requests_total{api="messages",outcome="aborted"}'] == "1"
    assert samples["deepinfer_num_requests_running"] == "3" and samples["deepinfer_num_requests_waiting"] == "1"
    assert samples["deepinfer_prefix_cache_hit_rate"] == "0.25"
    assert "# TYPE deepinfer_time_to_first_token_seconds histogram" in text


def test_render_reports_expert_load_balance_when_the_engine_rebalances() -> None:
    eplb = {"num_rebalances": 2, "balance_before": 1.8, "balance_after": 1.05, "pause_s": 0.25, "num_moved": 3}
    text = ServerMetrics().render({"eplb": eplb})
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert samples["deepinfer_eplb_balance"] == "1.8" and samples["deepinfer_eplb_balance_after_rebalance"] == "1.05"
    assert samples["deepinfer_eplb_rebalances"] == "2" and samples["deepinfer_eplb_last_pause_seconds"] == "0.25"
    assert "eplb" not in ServerMetrics().render({})
