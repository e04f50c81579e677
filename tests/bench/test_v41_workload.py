"""`bench/gpu_decode.py --model v41` runs end to end on the CPU with tiny shapes (its check mode)."""

from __future__ import annotations

from tests.test_bench_scripts import json_lines, run_script


def test_the_v41_workload_measures_v41_and_its_v4_peer_with_floors():
    rows = json_lines(run_script("bench/gpu_decode.py", "--model", "v41", "--tiny", "--layers", "7", "--experts", "8",
                                 "--batches", "1", "--new-tokens", "3"))
    assert rows[0]["workload"] == "v41flash-7x8" and rows[0]["peer"] == "v4flash-7x8"
    measured = {r["side"]: r for r in rows if "decode_tok_s" in r}
    assert set(measured) == {"deepinfer-v41", "deepinfer-v4"}
    for row in measured.values():
        assert row["decode_tok_s"] > 0 and 0 <= row["decode_of_floor"] < 1 and 0 <= row["prefill_of_floor"] < 1
    greedy = next(r for r in rows if "greedy_bs1_8" in r)["greedy_bs1_8"]
    assert len(greedy["deepinfer-v41"]) == 8
