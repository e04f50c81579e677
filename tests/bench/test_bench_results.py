"""`bench/bench_results.py`: each GPU bench run appends its points to `bench/results/<script>.jsonl`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_results


def test_record_appends_one_object_a_point_with_card_commit_and_date(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BENCH_RESULTS", str(tmp_path / "out"))
    first = bench_results.record("quant_decode", [{"batch": 1, "tok_s": 10.0}, {"batch": 16, "tok_s": 90.0}],
                                 "NVIDIA H100 80GB HBM3", "abc1234")
    bench_results.record("quant_decode", [{"batch": 64, "tok_s": 300.0}], "NVIDIA H100 80GB HBM3", "abc1234")
    assert first == tmp_path / "out" / "quant_decode.jsonl"
    points = [json.loads(line) for line in first.read_text().splitlines()]
    assert [p["batch"] for p in points] == [1, 16, 64]
    assert {p["script"] for p in points} == {"quant_decode"}
    assert {p["card"] for p in points} == {"NVIDIA H100 80GB HBM3"}
    assert {p["commit"] for p in points} == {"abc1234"}
    assert all(p["date"].endswith("Z") and len(p["date"]) == 20 for p in points)


def test_record_names_the_checkout_commit_when_none_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BENCH_RESULTS", str(tmp_path))
    assert bench_results.record("prefill_tiles", [], "card") is None
    path = bench_results.record("prefill_tiles", [{"ms": 1.0}], "card")
    commit = json.loads(path.read_text())["commit"]
    assert commit == bench_results.current_commit() and commit != ""
