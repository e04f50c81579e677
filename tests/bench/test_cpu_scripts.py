"""The bench scripts run end to end in their smoke modes on the CPU, so a bench never silently rots
(`gpu_decode.py --tiny` and `host_overhead.py` are in tests/test_bench_scripts.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.inprocess import run_main

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str, *args: str) -> list[dict]:
    """The script's JSON lines, its main run in this process (tests/bench/inprocess.py; it must exit 0)."""
    return [json.loads(line) for line in run_main(script, *args).splitlines() if line.startswith("{")]


def run_fresh(*args: str) -> list[dict]:
    """The script's JSON lines from a fresh interpreter (it must exit 0), for a script that must set the
    environment before a module it needs is first imported."""
    done = subprocess.run([sys.executable, *args], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_cpu_throughput_quick_times_both_sides_and_splits_the_steps():
    rows = [r for r in run_script("bench/cpu_throughput.py", "--quick") if "batch" in r]
    assert [r["batch"] for r in rows] == [4]
    row = rows[0]
    assert row["deepinfer_tok_s"] > 0 and row["transformers_tok_s"] > 0
    assert row["greedy"]["rows_compared"] == 4
    steps = row["deepinfer_steps"]
    assert steps["prefill"]["steps"] >= 1 and steps["decode"]["steps"] >= 1  # the timing split still sees steps
    assert set(steps["decode"]["ms_per_step"]) == {"schedule", "prepare", "forward", "sample", "other"}


def test_prefix_cache_reports_every_mode():
    # --quick's trace with 2 sessions instead of 4: still a batch, and a third turn hits blocks a hit wrote
    rows = {r["mode"]: r for r in run_script("bench/prefix_cache.py", "--sessions", "2", "--turns", "3",
                                             "--threads", "1") if "mode" in r}
    assert set(rows) == {"off", "bounded", "exact"}
    assert rows["off"]["hit_tokens"] == 0 and rows["bounded"]["hit_tokens"] > 0
    assert rows["bounded"]["hit_requests"] == rows["exact"]["hit_requests"] == 4  # turns 2 and 3 of each session
    # the exact replay reproduces the cold run; bounded replay is allowed to differ
    assert rows["exact"]["token_match"] == 1.0 and rows["exact"]["max_logprob_diff"] == 0.0


def test_prefill_tiles_tiny_runs_every_sweep():
    pytest.importorskip("triton", reason="the sweeps' kernels need triton (its interpreter on the CPU)")
    pytest.importorskip("deepinfer_nvidia_sm100", reason="the sweeps time the NVIDIA plugin's kernels")
    # a fresh process: --tiny sets TRITON_INTERPRET before the kernels are imported, which in this process
    # another test may have imported compiled
    rows = [r for r in run_fresh("bench/prefill_tiles.py", "--tiny") if "kernel" in r]
    assert not [r for r in rows if "error" in r]
    counts = {(r["kernel"], r.get("case")): 0 for r in rows}
    for r in rows:
        counts[r["kernel"], r.get("case")] += 1
    assert counts == {("attention", "hca"): 2, ("attention", "csa"): 2, ("hc_post_pre", None): 2,
                      ("moe_experts", None): 2, ("fp4_experts", None): 2}
    assert all(r["ms"] > 0 for r in rows)


def test_prefix_cache_store_runs_the_agent_trace_across_a_restart(tmp_path):
    rows = {r["mode"]: r for r in run_script("bench/prefix_cache.py", "--store", str(tmp_path / "kv"), "--threads", "1",
                                             "--agent-sessions", "3", "--agent-turns", "2", "--scale", "0.05",
                                             "--concurrency", "1") if "mode" in r}
    assert list(rows) == ["off", "device", "tiers", "restart"]
    assert all(r["answers_equal_off"] for r in rows.values())  # exact replay: every tier answers as a cold run
    assert rows["restart"]["hit_rate_store"] > 0 and rows["restart"]["second_half_store_hit_rate"] > 0
    for row in rows.values():
        assert {"hit_rate_device", "hit_rate_host", "prefill_vs_off", "effective_prefill_vs_off"} <= set(row)
        assert 0 < row["ceiling_hit_rate"] < 1 and row["hit_rate"] <= row["ceiling_hit_rate"]
    assert rows["restart"]["second_half_hit_rate"] <= rows["restart"]["second_half_ceiling_hit_rate"]


def test_agent_trace_ceiling_counts_full_blocks_seen_before():
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    import agent_trace

    trace = agent_trace.AgentTrace(system=[5] * 300, tools=[[[6] * 100, [7] * 50], [[8] * 10, [9] * 200]],
                                   answer_tokens=[[20, 20], [20, 20]], orders=[[1, 0], [0, 1]])
    answers = [[[1] * 20, [1] * 20], [[1] * 20, [1] * 20]]
    # session 1 comes first (nothing cached); session 0's first turn finds the system prompt (2 blocks);
    # second turns find the previous prompt + answer: 420 tokens (3 blocks), 330 tokens (2 blocks)
    assert agent_trace.ceiling_tokens(trace, answers, range(2)) == 256 + 384 + 256
    assert agent_trace.ceiling_tokens(trace, answers, range(1, 2)) == 384 + 256
    import prefix_cache

    assert prefix_cache.parse_args(["--store", "x", "--modes", "off,restart"]).modes == ["off", "restart"]
    with pytest.raises(SystemExit):
        prefix_cache.parse_args(["--store", "x", "--modes", "off,bogus"])
