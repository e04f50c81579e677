"""Time the plugin's kernels against PyTorch at DeepSeek-V4-Flash shapes, on one CUDA GPU.

    python plugins/nvidia_sm100/benchmarks/kernels.py [--quick]

Prints one JSON line per measurement (median ms, the floor in ms from counted bytes or FLOPs, the
speedup over the PyTorch version, and the relative error against it), then a short table.
Floors use the ceilings measured on one H200 (bench/README: 4.17 TB/s copy, 744 TFLOP/s bf16).
"""

# Timing lambdas are called within the loop iteration that defines them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton.testing
from deepinfer_nvidia_sm100.attention import TritonAttention
from deepinfer_nvidia_sm100.moe import GemmConfig, TritonMoE
from deepinfer_nvidia_sm100.sampling import CudaSampler
from triton.runtime.errors import OutOfResources

from deepinfer_core.backends import AttentionMetadata, AttentionSpec, MoESpec, MoEWeights, SamplingSpec
from deepinfer_core.reference.moe import route, swiglu
from deepinfer_core.reference.sampling import ReferenceSampler
from deepinfer_core.testing.cases import random_sampling_case

BANDWIDTH = 4.17e12
MATMUL_FLOPS = 744e12
ROWS: list[dict] = []


def timed(fn, graph: bool = False) -> float:
    """Median ms; with `graph`, of a CUDA-graph replay of `fn` (checks that it captures, too)."""
    if graph:
        fn()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return triton.testing.do_bench(g.replay, warmup=20, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")


def report(
    name: str, ours: float, torch_ms: float | None, floor_ms: float, error: float | None, **extra
) -> None:
    row = {
        "kernel": name,
        "ours_ms": round(ours, 4),
        "torch_ms": None if torch_ms is None else round(torch_ms, 4),
        "speedup": None if torch_ms is None else round(torch_ms / ours, 2),
        "floor_ms": round(floor_ms, 4),
        "of_floor": round(floor_ms / ours, 3),
        "rel_err": error,
        **extra,
    }
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ------------------------------------------------------------------------------------------------ MoE


def torch_grouped_moe(x: torch.Tensor, input_ids: torch.Tensor, w: MoEWeights, spec: MoESpec) -> torch.Tensor:
    """transformers' `grouped_mm` experts path, in plain torch ops (sort, torch._grouped_mm, sum)."""
    ids, weights = route(x.float(), input_ids, dataclasses.replace(w, router=w.router.float()), spec)
    flat = ids.reshape(-1)
    sorted_ids, perm = torch.sort(flat)
    xs = x[perm // spec.top_k]
    counts = torch.histc(sorted_ids.int(), bins=spec.num_experts, min=0, max=spec.num_experts - 1)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    h = swiglu(torch._grouped_mm(xs, w.gate_up.transpose(1, 2), offs=offsets), spec.swiglu_limit)
    y = torch._grouped_mm(h, w.down.transpose(1, 2), offs=offsets) * weights.reshape(-1)[perm, None].to(
        x.dtype
    )
    out = torch.zeros(flat.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    out[perm] = y.float()
    return out.view(x.shape[0], spec.top_k, -1).sum(1).to(x.dtype)


def bench_moe(token_counts: list[int]) -> None:
    e, h, i = 256, 4096, 2048
    spec = MoESpec(
        hidden_size=h,
        intermediate_size=i,
        num_experts=e,
        top_k=6,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        dtype=torch.bfloat16,
    )
    dev = "cuda"
    w = MoEWeights(
        router=torch.randn(e, h, device=dev, dtype=torch.bfloat16) * 0.02,
        gate_up=torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * 0.02,
        down=torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * 0.02,
        score_bias=torch.zeros(e, device=dev),
    )
    moe = TritonMoE(spec)
    for t in token_counts:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        ids_in = torch.zeros(t, dtype=torch.int64, device=dev)
        ours = moe.forward(x, ids_in, w)
        expected = torch_grouped_moe(x, ids_in, w, spec)
        touched = int(torch.unique(moe.route(x, ids_in, w)[0]).numel())
        bytes_moved = touched * 3 * i * h * 2 + e * h * 2 + 2 * t * h * 2
        flops = 2 * t * spec.top_k * 3 * i * h
        floor = max(bytes_moved / BANDWIDTH, flops / MATMUL_FLOPS) * 1e3
        ours_ms = timed(lambda: moe.forward(x, ids_in, w))
        graph_ms = timed(lambda: moe.forward(x, ids_in, w), graph=True)
        torch_ms = timed(lambda: torch_grouped_moe(x, ids_in, w, spec))
        report(
            f"moe T={t}",
            ours_ms,
            torch_ms,
            floor,
            rel(ours, expected),
            graph_ms=round(graph_ms, 4),
            experts_touched=touched,
        )
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ attention


def attention_case(spec: AttentionSpec, batch: int, context: int, query_len: int):
    dev, dt = "cuda", torch.bfloat16
    blocks_per_seq = -(-(context + query_len) // 128)
    tables = torch.randperm(batch * blocks_per_seq, device=dev).view(batch, blocks_per_seq)
    starts = [context] * batch
    lens = [query_len] * batch
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, device=dev) * query_len,
        start_positions=torch.full((batch,), context, device=dev),
        positions=(context + torch.arange(query_len, device=dev)).repeat(batch),
        slots=torch.randperm(batch, device=dev),
        block_tables=tables,
        query_lens=lens,
        start_positions_host=starts,
    )
    t = batch * query_len
    q = torch.randn(t, spec.num_heads, spec.head_dim, device=dev, dtype=dt)
    kv = torch.randn(t, spec.head_dim, device=dev, dtype=dt)
    window = torch.randn(batch, spec.sliding_window, spec.head_dim, device=dev, dtype=dt)
    comp = torch.randn(batch * blocks_per_seq * spec.entries_per_block, spec.head_dim, device=dev, dtype=dt)
    sinks = torch.randn(spec.num_heads, device=dev)
    topk = None
    if spec.is_sparse:
        visible = (meta.positions + 1) // spec.compress_rate
        scores = torch.rand(t, int(visible.max()), device=dev)
        scores = scores.masked_fill(torch.arange(scores.shape[1], device=dev)[None] >= visible[:, None], -1)
        vals, topk = scores.topk(min(spec.index_topk, scores.shape[1]), dim=-1)
        topk = torch.where(vals < 0, -1, topk)
    return q, kv, window, comp, sinks, meta, topk


def torch_attention(
    spec: AttentionSpec, q, kv, window, comp, sinks, meta: AttentionMetadata, topk
) -> torch.Tensor:
    """Gather every token's keys into `[T, n, D]`, then dense masked attention with the sink (torch ops)."""
    w = spec.sliding_window
    pos = meta.positions
    req = torch.searchsorted(meta.query_start_loc[1:], torch.arange(len(pos), device=pos.device), right=True)
    start, q_start, slot = meta.start_positions[req], meta.query_start_loc[req], meta.slots[req]
    p = pos[:, None] - w + 1 + torch.arange(w, device=pos.device)[None]
    ring = window[slot[:, None], p.clamp(min=0) % w]
    new = kv[(q_start[:, None] + p - start[:, None]).clamp(min=0, max=len(kv) - 1)]
    keys = torch.where((p < start[:, None])[..., None], ring, new)
    valid = p >= 0
    epb = spec.entries_per_block
    entries = (
        topk
        if spec.is_sparse
        else torch.arange(int(pos.max() + 1) // spec.compress_rate, device=pos.device)[None].expand(
            len(pos), -1
        )
    )
    ok = (entries >= 0) & (entries < ((pos + 1) // spec.compress_rate)[:, None])
    e = entries.clamp(min=0)
    rows = meta.block_tables[req[:, None], e // epb] * epb + e % epb
    keys = torch.cat([keys, comp[rows]], dim=1)
    valid = torch.cat([valid, ok], dim=1)
    scores = torch.einsum("thd,tnd->thn", q, keys).float() * spec.head_dim**-0.5
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    logits = torch.cat([scores, sinks[None, :, None].expand(len(pos), -1, 1)], dim=-1)
    probs = logits.softmax(-1)[..., :-1].to(q.dtype)
    return torch.einsum("thn,tnd->thd", probs, keys)


def bench_attention(configs: list[tuple[str, int, int, int]]) -> None:
    specs = {
        "hca": AttentionSpec(
            num_heads=64, head_dim=512, sliding_window=128, compress_rate=128, dtype=torch.bfloat16
        ),
        "csa": AttentionSpec(
            num_heads=64,
            head_dim=512,
            sliding_window=128,
            compress_rate=4,
            index_n_heads=64,
            index_head_dim=128,
            index_topk=512,
            dtype=torch.bfloat16,
        ),
    }
    for kind, batch, context, query_len in configs:
        spec = specs[kind]
        q, kv, window, comp, sinks, meta, topk = attention_case(spec, batch, context, query_len)
        backend = TritonAttention(spec)

        def ours():
            return backend.forward(q, kv, window, comp, sinks, meta, topk)

        out = ours()
        expected = torch_attention(spec, q, kv, window, comp, sinks, meta, topk)
        t = batch * query_len
        n_comp = topk.shape[1] if topk is not None else (context + query_len) // spec.compress_rate
        n_keys = spec.sliding_window + n_comp
        key_bytes = (batch * n_keys if query_len == 1 else batch * (context + query_len)) * spec.head_dim * 2
        bytes_moved = 2 * q.numel() * 2 + key_bytes
        flops = 4 * t * spec.num_heads * n_keys * spec.head_dim
        floor = max(bytes_moved / BANDWIDTH, flops / MATMUL_FLOPS) * 1e3
        ours_ms = timed(ours)
        graph_ms = timed(ours, graph=True)
        torch_ms = timed(lambda: torch_attention(spec, q, kv, window, comp, sinks, meta, topk))
        report(
            f"attn {kind} B={batch} ctx={context} q={query_len}",
            ours_ms,
            torch_ms,
            floor,
            rel(out, expected),
            graph_ms=round(graph_ms, 4),
        )


# -------------------------------------------------------------------------------------------- sampler


def bench_sampler(batches: list[int]) -> None:
    spec = SamplingSpec(vocab_size=129280)
    sampler, reference = CudaSampler(spec), ReferenceSampler(spec, torch.device("cuda"))
    for batch in batches:
        logits, params = random_sampling_case(spec, seed=batch)
        reps = -(-batch // 8)
        logits = logits.repeat(reps, 1)[:batch].cuda()
        fields = {
            n: getattr(params, n).repeat(reps)[:batch].cuda()
            for n in ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")
        }
        params = type(params)(**{**params.__dict__, **fields, "banned_token_ids": None})
        same = torch.equal(
            sampler.sample(logits, params).token_ids, reference.sample(logits, params).token_ids
        )
        floor = logits.numel() * 4 / BANDWIDTH * 1e3
        report(
            f"sampler B={batch}",
            timed(lambda: sampler.sample(logits, params)),
            timed(lambda: reference.sample(logits, params)),
            floor,
            None,
            same_tokens=same,
        )


def sweep_moe(token_counts: list[int]) -> None:
    """Graph-replayed time of the expert GEMMs (routing excluded) for several tile configs."""
    e, h, i = 256, 4096, 2048
    spec = MoESpec(
        hidden_size=h,
        intermediate_size=i,
        num_experts=e,
        top_k=6,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        dtype=torch.bfloat16,
    )
    w = MoEWeights(
        router=torch.randn(e, h, device="cuda", dtype=torch.bfloat16) * 0.02,
        gate_up=torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02,
        down=torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02,
    )
    moe = TritonMoE(spec)
    configs = [
        GemmConfig(16, n, k, warps, stages)
        for n in (16, 32, 64)
        for k in (64, 128, 256)
        for warps, stages in ((4, 3), (4, 5))
    ]
    for t in token_counts:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        ids, weights = moe.route(x, torch.zeros(t, dtype=torch.int64, device="cuda"), w)
        touched = int(torch.unique(ids).numel())
        floor = touched * 3 * i * h * 2 / BANDWIDTH * 1e3
        results = []
        for c in configs + ([GemmConfig(64, 64, 64, 4, 4), GemmConfig(32, 64, 128, 4, 4)] if t >= 64 else []):
            try:
                ms = timed(lambda c=c: moe.experts(x, ids, weights, w, config=c), graph=True)
            except OutOfResources as exc:  # a config that needs too much shared memory is skipped
                print(json.dumps({"sweep": t, "config": dataclasses.astuple(c), "error": str(exc)[:80]}))
                continue
            results.append((ms, c))
        results.sort(key=lambda r: r[0])
        for ms, c in results[:4]:
            print(
                json.dumps(
                    {
                        "sweep_T": t,
                        "config": dataclasses.astuple(c),
                        "ms": round(ms, 4),
                        "of_floor": round(floor / ms, 3),
                    }
                ),
                flush=True,
            )
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--sweep-moe", action="store_true", help="only time MoE tile configs")
    args = parser.parse_args()
    if args.sweep_moe:
        sweep_moe([1, 16, 64, 256])
        return
    torch.manual_seed(0)
    print(
        json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
        )
    )
    bench_moe([1, 16, 64] if args.quick else [1, 16, 64, 256, 4096])
    bench_attention(
        [
            ("hca", 1, 512, 1),
            ("csa", 1, 4096, 1),
            ("hca", 64, 512, 1),
            ("csa", 64, 4096, 1),
            ("hca", 8, 0, 512),
            ("csa", 8, 0, 512),
        ]
    )
    bench_sampler([1, 64, 256])
    print(
        f"{'kernel':34s} {'ours ms':>9s} {'torch ms':>9s} {'speedup':>8s} {'floor ms':>9s} {'of floor':>8s} {'rel err':>9s}"
    )
    for r in ROWS:
        err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else str(r.get("same_tokens", ""))
        print(
            f"{r['kernel']:34s} {r['ours_ms']:9.4f} {r['torch_ms'] or 0:9.4f} {r['speedup'] or 0:8.2f} "
            f"{r['floor_ms']:9.4f} {r['of_floor']:8.3f} {err:>9s}"
        )


if __name__ == "__main__":
    main()
