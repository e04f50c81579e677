"""`bench/spec_decode.py --tiny` runs every case on the CPU and its runs keep the greedy tokens."""

from __future__ import annotations

from tests.bench.test_cpu_scripts import run_script


def test_spec_decode_tiny_reports_every_case_with_unchanged_tokens():
    rows = run_script("bench/spec_decode.py", "--tiny", "--layers", "2", "--batches", "1", "--ks", "2",
                      "--new-tokens", "4")
    cases = [row["case"] for row in rows if "case" in row]
    assert cases == ["none", "oracle", "always_wrong", "always_wrong", "ngram_agent_trace"]
    assert all(row["tokens_equal"] for row in rows if "tokens_equal" in row)
    oracle = [row for row in rows if row.get("case") == "oracle"]
    assert [row["k"] for row in oracle] == [2] and all(row["allowed_speedup"] > 1 for row in oracle)
