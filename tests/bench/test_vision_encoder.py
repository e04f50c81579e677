"""bench/vision_encoder.py runs end to end in its CPU smoke mode (the tiny tower)."""

from __future__ import annotations

from tests.bench.test_cpu_scripts import run_script


def test_vision_encoder_tiny_times_each_size():
    rows = run_script("bench/vision_encoder.py", "--tiny")
    assert rows[0]["device"] == "cpu" and rows[0]["vision_layers"] == 2
    sizes = {r["size"]: r for r in rows if "size" in r}
    assert set(sizes) == {"126x126", "42x168"}
    assert sizes["126x126"]["patches"] == 81 and sizes["126x126"]["span_positions"] == 3 * 4 + 2
    assert sizes["42x168"]["span_positions"] == 1 * 5 + 2
    assert all(r["ms_per_image"] > 0 and r["tower_ms"] > 0 for r in sizes.values())
