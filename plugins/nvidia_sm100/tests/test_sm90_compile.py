"""Every kernel a tiny V4 (bf16, and FP8/FP4 quantised) and V4.1 forward launches compiles for sm_90.

The interpreter tests check what the kernels compute; this one checks that Triton's compiler takes them
(`sm90_compile.py` drives the plugin's backends with a compile-only stand-in for the CUDA driver), so a
kernel the device would reject fails here, on any machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")
ROOT = Path(__file__).resolve().parents[3]


GROUPS = (("v4", "v4-quant", "v4-det", "fp4-prefill"), ("v41", "v41-det"))
"""The families in two processes that compile side by side (compiling is CPU-bound): V4's, which share
their shapes and so many of their compiles, and V4.1's; the two take about as long cold."""


def test_every_kernel_of_the_tiny_models_compiles_for_sm90():
    pytest.importorskip("triton", reason="compiling the kernels needs triton")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    with ThreadPoolExecutor(len(GROUPS)) as pool:
        runs = list(pool.map(lambda group: subprocess.run([sys.executable, str(SCRIPT), *group], capture_output=True,
                                                          text=True, env=env, cwd=ROOT, timeout=900, check=False),
                             GROUPS))
    for done in runs:
        assert done.returncode == 0, done.stderr[-4000:]
    rows = {row["model"]: row for done in runs for row in map(json.loads, done.stdout.splitlines())}
    assert set(rows) == {"v4", "v4-quant", "v41", "v4-det", "v41-det", "fp4-prefill"}
    assert {"gate_up_kernel", "down_kernel", "fp4_dequant_kernel", "fp4_mma_gate_up_kernel",
            "fp4_mma_down_kernel"} <= set(rows["fp4-prefill"]["kernels"])
    assert {"attention_kernel", "gate_up_kernel", "down_kernel", "route_kernel", "hyper_kernel"} <= set(rows["v4"]["kernels"])
    assert rows["v4-quant"]["backends"] == ["TritonFP8Linear", "TritonMoE"]
    assert {"act_quant_kernel", "fp8_gemm_kernel", "fp4_mma_gate_up_kernel", "fp4_mma_down_kernel"} <= set(
        rows["v4-quant"]["kernels"])
    assert {"attention_kernel", "route_kernel", "hyper_kernel", "indexer_scores_kernel"} <= set(rows["v41"]["kernels"])
    for family in ("v4-det", "v41-det"):
        assert rows[family]["backends"] == ["CudaSampler", "InvariantTritonAttention", "InvariantTritonLayerOps",
                                            "InvariantTritonMoE"]
        assert {"invariant_attention_kernel", "hyper_tail_kernel", "log_softmax_kernel"} <= set(rows[family]["kernels"])
    assert {"fp4_mma_gate_up_kernel", "indexer_scores_kernel"} <= set(rows["v41-det"]["kernels"])
    assert all(row["target"] == "sm_90" for row in rows.values())
