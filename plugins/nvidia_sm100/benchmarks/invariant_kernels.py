"""Time deterministic mode's kernels against the default ones at DeepSeek-V4-Flash shapes, on one CUDA GPU.

    python plugins/nvidia_sm100/benchmarks/invariant_kernels.py

Per kernel family and step size, the CUDA-graph replay time of the default backend and of its
batch-invariant variant (`invariant_attention`, `invariant_moe`, `invariant_layer_ops`), and their ratio
(`det_over_default`, > 1: deterministic is slower), one JSON line each: attention (CSA and HCA, decode at
batch 1/16/64 over 512-token contexts, a 16 x 512-token prefill), routed MoE (1/16/64/2,048 tokens), the
mHC boundary and RMSNorm (1/16/64/2,048 rows), and a projection through `map_rows` (4096 -> 4096).
Where `bench/gpu_decode.py --deterministic` shows a gap, this says which kernel makes it.
"""

# Timing lambdas are called within the loop iteration that defines them.
# ruff: noqa: B023

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from kernels import attention_case, timed

from deepinfer_core.backends import AttentionSpec, HyperWeights, LayerOpsSpec, MoESpec, MoEWeights

DEV = "cuda"


def row(family: str, size: str, default_ms: float, det_ms: float) -> None:
    print(json.dumps({"kernel": family, "size": size, "default_ms": round(default_ms, 4),
                      "deterministic_ms": round(det_ms, 4), "det_over_default": round(det_ms / default_ms, 3)}),
          flush=True)


def bench_attention() -> None:
    from deepinfer_nvidia_sm100.attention import TritonAttention
    from deepinfer_nvidia_sm100.invariant_attention import InvariantTritonAttention

    specs = {"csa": AttentionSpec(num_heads=64, head_dim=512, sliding_window=128, compress_rate=4, index_n_heads=64,
                                  index_head_dim=128, index_topk=512, dtype=torch.bfloat16),
             "hca": AttentionSpec(num_heads=64, head_dim=512, sliding_window=128, compress_rate=128,
                                  dtype=torch.bfloat16)}
    for name, spec in specs.items():
        default, det = TritonAttention(spec), InvariantTritonAttention(dataclasses.replace(spec, deterministic=True))
        for batch, context, query_len in ((1, 2048, 1), (16, 2048, 1), (64, 2048, 1), (16, 0, 512)):
            q, kv, window, comp, sinks, meta, topk = attention_case(spec, batch, context, query_len)
            meta = dataclasses.replace(meta, max_seq_len=context + query_len)
            args = (q, kv, window, comp, sinks, meta, topk)
            graph = query_len == 1
            row(f"attention {name}", f"bs{batch} ctx{context} q{query_len}",
                timed(lambda: default.forward(*args), graph=graph), timed(lambda: det.forward(*args), graph=graph))


def bench_moe() -> None:
    from deepinfer_nvidia_sm100.invariant_moe import InvariantTritonMoE
    from deepinfer_nvidia_sm100.moe import TritonMoE

    e, h, i = 256, 4096, 2048
    spec = MoESpec(hidden_size=h, intermediate_size=i, num_experts=e, top_k=6, scoring_func="sqrtsoftplus",
                   routed_scaling_factor=1.5, swiglu_limit=10.0, dtype=torch.bfloat16)
    w = MoEWeights(router=torch.randn(e, h, device=DEV, dtype=torch.bfloat16) * 0.02,
                   gate_up=torch.randn(e, 2 * i, h, device=DEV, dtype=torch.bfloat16) * 0.02,
                   down=torch.randn(e, h, i, device=DEV, dtype=torch.bfloat16) * 0.02,
                   score_bias=torch.zeros(e, device=DEV))
    default, det = TritonMoE(spec), InvariantTritonMoE(dataclasses.replace(spec, deterministic=True))
    for t in (1, 16, 64, 2048):
        x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
        ids = torch.zeros(t, dtype=torch.int64, device=DEV)
        row("moe", f"T{t}", timed(lambda: default.forward(x, ids, w), graph=True),
            timed(lambda: det.forward(x, ids, w), graph=True))


def bench_layer_ops() -> None:
    from deepinfer_nvidia_sm100.invariant_layer_ops import InvariantTritonLayerOps
    from deepinfer_nvidia_sm100.layer_ops import TritonLayerOps

    n, hidden = 4, 4096
    spec = LayerOpsSpec(hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                        dtype=torch.bfloat16)
    default = TritonLayerOps(spec, torch.device(DEV))
    det = InvariantTritonLayerOps(dataclasses.replace(spec, deterministic=True), torch.device(DEV))
    hc = HyperWeights(fn=torch.randn((2 + n) * n, n * hidden, device=DEV) * 0.01,
                      base=torch.randn((2 + n) * n, device=DEV), scale=torch.ones(3, device=DEV))
    norm = torch.ones(hidden, device=DEV)
    proj = torch.randn(hidden, hidden, device=DEV, dtype=torch.bfloat16) * 0.02
    for t in (1, 16, 64, 2048):
        streams = torch.randn(t, n, hidden, device=DEV, dtype=torch.bfloat16)
        out = torch.randn(t, hidden, device=DEV, dtype=torch.bfloat16)
        post, comb = torch.rand(t, n, device=DEV), torch.softmax(torch.randn(t, n, n, device=DEV), -1)
        for name, call in (("hc_post_pre", lambda ops: ops.hc_post_pre(streams, out, post, comb, hc, norm)),
                           ("rms_norm", lambda ops: ops.rms_norm(out, norm)),
                           ("map_rows linear", lambda ops: ops.map_rows(lambda r: F.linear(r, proj), out))):
            row(name, f"T{t}", timed(lambda: call(default), graph=True), timed(lambda: call(det), graph=True))


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (compute capability >= 9.0)")
    bench_attention()
    bench_moe()
    bench_layer_ops()


if __name__ == "__main__":
    main()
