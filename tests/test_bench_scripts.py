"""The GPU bench scripts still run end to end, on the CPU with a tiny model (their check modes); each main
runs in the test process (tests/bench/inprocess.py), the start-up bench still times fresh child processes."""

from __future__ import annotations

import json

from tests.bench.inprocess import run_main


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_gpu_decode_tiny_measures_both_sides_and_checks_greedy_parity():
    rows = json_lines(run_main("bench/gpu_decode.py", "--tiny", "--batches", "1,2", "--new-tokens", "5",
                               "--repeats", "1"))
    measured = {(r["side"], r["batch"]) for r in rows if "side" in r}
    assert measured == {(side, b) for side in ("transformers", "deepinfer") for b in (1, 2)}
    for row in rows:
        if "side" in row:
            assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["ttft_s"] > 0
    parity = next(r for r in rows if "greedy_tokens_equal_bs1_8" in r)
    assert parity["greedy_tokens_equal_bs1_8"] and len(parity["deepinfer"]) == 8
    engine = next(r for r in rows if "backends" in r)
    assert engine["max_num_batched_tokens"] == 8192 and engine["async_scheduling"] is False  # CPU defaults


def test_quant_decode_tiny_runs_fp8_projections_and_fp4_experts_with_their_smaller_floor():
    rows = json_lines(run_main("bench/quant_decode.py", "--tiny", "--batches", "1", "--new-tokens", "3",
                               "--repeats", "1"))
    engines = {r["engine"]: r for r in rows if "engine" in r}
    quantised, dense = engines["fp8+fp4"], engines["bf16"]
    assert quantised["expert_format"] == ["fp4"] and dense["expert_format"] == ["dense"]
    assert quantised["fp8_projections"] > 0 and quantised["linear_backends"] == ["ReferenceLinear"]
    assert dense["fp8_projections"] == 0 and quantised["weight_gib"] < dense["weight_gib"]
    assert next(r for r in rows if "greedy_tokens_equal_bs1_8" in r)["greedy_tokens_equal_bs1_8"]
    floors = {r["side"]: r["step_floor_bytes"] for r in rows if "step_floor_bytes" in r}
    assert floors["deepinfer-fp8+fp4"] < floors["deepinfer-bf16"]


def test_quant_decode_startup_times_a_cold_and_a_warm_start():
    rows = json_lines(run_main("bench/quant_decode.py", "--tiny", "--batches", "1", "--startup",
                               "--startup-engines", "quant"))
    starts = {(r["startup"], r["cache"]): r for r in rows if "startup" in r}
    assert set(starts) == {("fp8+fp4", "cold"), ("fp8+fp4", "warm")}
    for row in starts.values():
        assert "error" not in row, row.get("error")
        assert row["ready_s"] >= row["build_s"] > 0 and row["first_request_s"] > 0


def test_host_overhead_reports_every_mode_and_batch():
    table = run_main("bench/host_overhead.py", "--batch", "1,4", "--steps", "4")
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith(("| eager", "| graph"))]
    assert sorted((mode.strip(), int(batch)) for mode, batch in rows) == [("eager", 1), ("eager", 4), ("graph", 1), ("graph", 4)]


def test_ep_scale_reports_every_rank_and_the_balance_eplb_reaches():
    rows = json_lines(run_main("bench/ep_scale.py", "--ranks", "2", "--requests", "2", "--prompt", "16",
                               "--new-tokens", "8", "--step-interval", "3", "--window", "3"))
    ranks = [r for r in rows if "rank" in r]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["tok_s"] > 0 and 0 < r["dispatch_s"] < r["step_s"] for r in ranks)
    balance = next(r for r in rows if "balance_initial" in r)
    assert balance["rebalances"] >= 2 and balance["balance_initial"] > 1.3  # skewed on purpose
    assert balance["balance_predicted"] < balance["balance_initial"]
