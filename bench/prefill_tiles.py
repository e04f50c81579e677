"""Tile sweeps of the NVIDIA plugin's prefill kernels at V4-Flash sizes (bf16), one CUDA GPU.

Times, with `triton.testing.do_bench`, each candidate tiling of
- attention (16 requests x 512 prompt tokens, CSA with top-512 and HCA at rate 128): heads a program,
  keys a step, warps, stages (`TritonAttention.tiles["prefill"]`);
- the mHC block boundary `hc_post_pre` (hidden 4096, hc_mult 4): tokens a program beyond 1,024 tokens, one
  launch or two, the `fn` dot in fp32 or on tensor cores;
- the routed experts' two grouped GEMMs (hidden 4096, intermediate 2048, 256 experts, top 6): `GemmConfig`;
- the same GEMMs on FP4 experts (`fp4`), at decode and prefill token counts: the CUDA-core products
  ("gemv"), the tensor-core tiles decoded in registers ("tile") and the experts dequantised to bf16 before
  the dense tiles ("dequant"), with several tilings, beside the bf16 experts; each row gives the touched experts' FP4 bytes (their
  bytes a second are the decode figure of merit);
and prints one JSON line per candidate with its time and its largest difference from the first one.
`bench/RESULTS.md` records what the H200 gave and which tiles the plugin keeps.

    python bench/prefill_tiles.py [--only attention,hyper,moe,fp4] [--tiny]

`--tiny` is the smoke mode the test suite runs: tiny sizes, the first two candidates of each sweep, one
untimed-quality run each (wall clock, not `do_bench`); without a CUDA device the kernels run in Triton's
interpreter on the CPU. Its times mean nothing; it proves the sweeps still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sizes:
    """The shapes each sweep runs at."""

    heads: int = 64
    head_dim: int = 512
    window: int = 128
    hca_rate: int = 128
    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    prompts: tuple[int, ...] = (512,) * 16
    hidden: int = 4096
    hyper_tokens: tuple[int, ...] = (256, 2048, 8192)
    moe_intermediate: int = 2048
    experts: int = 256
    top_k: int = 6
    moe_tokens: tuple[int, ...] = (2048, 8192)
    fp4_tokens: tuple[int, ...] = (1, 16, 64, 256, 2048, 8192)
    num_variants: int | None = None
    """Candidates per sweep (None: all)."""


V4_FLASH = Sizes()
TINY = Sizes(heads=16, head_dim=64, window=16, hca_rate=8, index_heads=4, index_head_dim=32, index_topk=8,
             prompts=(32, 32), hidden=128, hyper_tokens=(8,), moe_intermediate=64, experts=8, top_k=2,
             moe_tokens=(16,), fp4_tokens=(2,), num_variants=2)

ATTENTION_TILES = [(16, 32, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2), (64, 32, 8, 2), (64, 32, 8, 1),
                   (16, 64, 4, 2), (32, 64, 8, 2), (64, 64, 8, 1)]
HYPER_VARIANTS = [
    {"TWO_PASS_MIN_ROWS": 1 << 30, "TENSOR_CORE_DOT": False},  # one launch, fp32 dot (the earlier kernel)
    {"TWO_PASS_MIN_ROWS": 1 << 30},
    {}, {"TAIL_TOKENS": 2}, {"TAIL_TOKENS": 8},
    {"TWO_PASS_TILE": (64, 4, 4)}, {"TWO_PASS_TILE": (32, 4, 4)}, {"TWO_PASS_TILE": (32, 8, 4)},
    {"TWO_PASS_TILE": (64, 8, 2)}, {"TWO_PASS_TILE": (64, 8, 8)}, {"TWO_PASS_TILE": (32, 4, 8)},
]
"""mHC: module settings of `hyper_kernels` that differ from the plugin's (tokens a program, one launch or
two, the `fn` dot on tensor cores, the two-pass tiles)."""


_WIDE = (128, 128, 64, 8, 3, True)
MOE_TILES = [((64, 256, 64, 8, 3, True), None), ((64, 64, 64, 4, 4, True), None),
             ((64, 64, 64, 4, 4, True), (64, 128, 64, 4, 4, True)), ((64, 64, 64, 4, 4, True), (64, 256, 64, 8, 3, True)),
             (_WIDE, None), ((128, 128, 64, 8, 3, False), None), (_WIDE, (128, 256, 64, 8, 3, True)),
             (_WIDE, (128, 256, 64, 8, 4, True)), (_WIDE, (128, 128, 128, 8, 3, True)),
             ((128, 128, 64, 8, 4, True), (128, 256, 64, 8, 3, True))]
"""`(gate_up, down)` `GemmConfig` fields (block_m, block_n, block_k, num_warps, num_stages, n_fastest); down
`None`: the same as gate_up."""


POINTS: list[dict] = []
"""The timed candidates of this run, recorded at its end (`bench_results.record`)."""


def report(**row) -> None:
    print(json.dumps(row), flush=True)
    if "ms" in row:
        POINTS.append({**row, "variant": str(row["variant"])})


def time_variants(label: str, variants, run, sizes: Sizes, **fields) -> None:
    """Time `run(variant)` for each variant; a variant that fails to compile is reported, not fatal."""
    first = None
    for variant in variants[: sizes.num_variants]:
        try:
            out = run(variant)
            outs = out if isinstance(out, tuple) else (out,)
            first = first or outs
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, first))
            ms = _milliseconds(lambda v=variant: run(v), sizes)
            report(kernel=label, variant=variant, ms=round(ms, 3), max_diff_vs_first=diff, **fields)
        except Exception as err:  # noqa: BLE001 - e.g. a tile over the shared-memory limit
            report(kernel=label, variant=variant, error=str(err)[:200], **fields)


def _milliseconds(fn, sizes: Sizes) -> float:
    if sizes.num_variants is not None:  # the smoke mode: one wall-clock run
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=30)


def sweep_attention(device: torch.device, sizes: Sizes) -> None:
    from deepinfer_nvidia_sm100.attention import TritonAttention

    from deepinfer_core.backends.attention import AttentionSpec
    from deepinfer_core.testing.cases import random_attention_case

    shape = {"num_heads": sizes.heads, "head_dim": sizes.head_dim, "sliding_window": sizes.window,
             "dtype": torch.bfloat16}
    specs = {
        "hca": AttentionSpec(compress_rate=sizes.hca_rate, **shape),
        "csa": AttentionSpec(compress_rate=4, index_n_heads=sizes.index_heads, index_head_dim=sizes.index_head_dim,
                             index_topk=sizes.index_topk, **shape),
    }
    prompts = list(sizes.prompts)
    for name, spec in specs.items():
        case = random_attention_case(spec, prompts, [0] * len(prompts), poison=False).to(device, torch.bfloat16)
        backend = TritonAttention(spec)

        def run(tiles, backend=backend, case=case):
            backend.tiles["prefill"] = tiles
            return backend.forward(case.q, case.kv, case.window, case.compressed, case.sinks, case.metadata,
                                   case.topk_indices, case.num_entries)

        time_variants("attention", ATTENTION_TILES, run, sizes, case=name)


def sweep_hyper(device: torch.device, sizes: Sizes) -> None:
    from deepinfer_nvidia_sm100 import hyper_kernels

    from deepinfer_core.backends.layer_ops import HyperWeights, LayerOpsSpec

    hidden, n = sizes.hidden, 4
    spec = LayerOpsSpec(hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                        dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = (2 + n) * n
    hc = HyperWeights(torch.randn(rows, n * hidden, device=device, generator=gen) * 0.01,
                      torch.randn(rows, device=device, generator=gen) * 0.1, torch.ones(3, device=device))
    norm_weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    counters = hyper_kernels.new_split_counters(device)
    for num_tokens in sizes.hyper_tokens:
        streams = torch.randn(num_tokens, n, hidden, device=device, dtype=torch.bfloat16)
        block_out = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16)
        post = torch.rand(num_tokens, n, device=device)
        comb = torch.rand(num_tokens, n, n, device=device)

        def run(variant, streams=streams, block_out=block_out, post=post, comb=comb):
            saved = {name: getattr(hyper_kernels, name) for name in variant}
            for name, value in variant.items():
                setattr(hyper_kernels, name, value)
            try:
                return hyper_kernels.hc_post_pre(streams, block_out, post, comb, hc, norm_weight, spec,
                                                 counters=counters)
            finally:
                for name, value in saved.items():
                    setattr(hyper_kernels, name, value)

        time_variants("hc_post_pre", HYPER_VARIANTS, run, sizes, tokens=num_tokens)


def sweep_moe(device: torch.device, sizes: Sizes) -> None:
    from deepinfer_nvidia_sm100.moe import GemmConfig, TritonMoE

    from deepinfer_core.backends.moe import MoESpec, MoEWeights

    hidden, inter, experts, top_k = sizes.hidden, sizes.moe_intermediate, sizes.experts, sizes.top_k
    spec = MoESpec(hidden, inter, experts, top_k, "sqrtsoftplus", 1.5, 10.0, False, torch.bfloat16)
    weights = MoEWeights(
        router=torch.randn(experts, hidden, device=device, dtype=torch.bfloat16) * 0.02,
        gate_up=torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) * 0.02,
        down=torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16) * 0.02,
    )
    moe = TritonMoE(spec)
    for num_tokens in sizes.moe_tokens:
        x = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16)
        ids = torch.rand(num_tokens, experts, device=device).topk(top_k).indices.to(torch.int32)
        topk_weights = torch.rand(num_tokens, top_k, device=device)

        def run(tiles, x=x, ids=ids, topk_weights=topk_weights):
            gate_up, down = tiles
            return moe.experts(x, ids, topk_weights, weights, GemmConfig(*gate_up), down and GemmConfig(*down))

        time_variants("moe_experts", MOE_TILES, run, sizes, tokens=num_tokens)


FP4_VARIANTS = {
    "decode": [("gemv", (16, 32, 256, 4, 2)), ("mma", (16, 64, 64, 4, 4)), ("mma", (16, 64, 128, 4, 3)),
               ("mma", (16, 128, 128, 8, 3)), ("mma_words", (16, 64, 128, 4, 4)), ("mma_words", (16, 64, 256, 4, 3)),
               ("mma_words", (16, 128, 128, 4, 3)), ("mma_words", (16, 128, 256, 8, 3)),
               ("mma_words", (16, 64, 256, 4, 4, True)), ("mma_pairs", (16, 64, 256, 4, 3)),
               ("mma_pairs", (16, 128, 256, 8, 3)), ("mma_halves", (16, 64, 128, 4, 3))],
    "prefill": [("dequant", (64, 64, 64, 4, 4, True)), ("mma", (64, 64, 64, 4, 4, True)),
                ("mma", (64, 128, 64, 8, 4, True)), ("mma", (128, 128, 64, 8, 4, True)),
                ("mma_words", (64, 64, 128, 4, 3, True)), ("mma_words", (64, 128, 128, 8, 3, True)),
                ("mma_words", (128, 128, 128, 8, 3, True)), ("mma_pairs", (64, 128, 128, 8, 3, True)),
                ("mma_pairs", (128, 128, 128, 8, 3, True)), ("mma_halves", (64, 128, 64, 8, 3, True))],
}
"""FP4 `GemmConfig` kernels and tiles (block_m, block_n, block_k, num_warps, num_stages[, n_fastest]) at
decode sizes (at most 16 rows an expert) and beyond."""


def _dequantized(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 values of packed FP4 experts, one expert at a time (the whole set at once takes 4x its bf16
    size in fp32 and index temporaries: more than an 80 GB card has beside the weights)."""
    from deepinfer_core.backends import quant

    out = torch.empty(codes.shape[0], codes.shape[1], 2 * codes.shape[2], dtype=torch.bfloat16, device=codes.device)
    for expert in range(codes.shape[0]):
        out[expert] = quant.dequantize_fp4(codes[expert], scales[expert])
    return out


def sweep_fp4(device: torch.device, sizes: Sizes) -> None:
    from deepinfer_nvidia_sm100.moe import GemmConfig, TritonMoE

    from deepinfer_core.backends import quant
    from deepinfer_core.backends.moe import MoESpec, MoEWeights

    hidden, inter, experts, top_k = sizes.hidden, sizes.moe_intermediate, sizes.experts, sizes.top_k
    spec = MoESpec(hidden, inter, experts, top_k, "sqrtsoftplus", 1.5, 10.0, False, torch.bfloat16,
                   expert_format="fp4")
    gen = torch.Generator(device=device).manual_seed(0)

    def packed(rows: int, cols: int):
        codes = torch.randint(-128, 128, (experts, rows, cols // 2), dtype=torch.int8, device=device, generator=gen)
        exponents = torch.randint(-9, -6, (experts, rows, cols // quant.FP4_GROUP_SIZE), device=device, generator=gen)
        return codes, torch.exp2(exponents.float()).to(quant.FP4_SCALE_DTYPE)

    (gate_up, gate_up_scale), (down, down_scale) = packed(2 * inter, hidden), packed(hidden, inter)
    router = torch.randn(experts, hidden, device=device, dtype=torch.bfloat16) * 0.02
    fp4 = MoEWeights(router=router, gate_up=gate_up, down=down, gate_up_scale=gate_up_scale, down_scale=down_scale)
    dense = MoEWeights(router=router, gate_up=_dequantized(gate_up, gate_up_scale), down=_dequantized(down, down_scale))
    moe, dense_moe = TritonMoE(spec), TritonMoE(dataclasses.replace(spec, expert_format="dense"))
    fp4_bytes = 3 * inter * hidden * (0.5 + 1 / quant.FP4_GROUP_SIZE)
    for num_tokens in sizes.fp4_tokens:
        x = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16)
        ids = torch.rand(num_tokens, experts, device=device).topk(top_k).indices.to(torch.int32)
        topk_weights = torch.rand(num_tokens, top_k, device=device)
        touched = ids.unique().numel()

        def run(variant, x=x, ids=ids, topk_weights=topk_weights):
            kernel, tiles = variant
            if kernel == "bf16":
                return dense_moe.experts(x, ids, topk_weights, dense)
            return moe.experts(x, ids, topk_weights, fp4, GemmConfig(*tiles, kernel=kernel))

        phase = "decode" if num_tokens * top_k / experts <= 16 else "prefill"
        time_variants("fp4_experts", [("bf16", None), *FP4_VARIANTS[phase]], run, sizes, tokens=num_tokens,
                      touched_experts=touched, fp4_gb_touched=round(touched * fp4_bytes / 1e9, 4))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="attention,hyper,moe,fp4", help="comma-separated sweeps to run")
    parser.add_argument("--tiny", action="store_true", help="smoke mode: tiny sizes, two candidates a sweep")
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else V4_FLASH
    if torch.cuda.is_available():
        device = torch.device("cuda")
        report(device=torch.cuda.get_device_name(), torch=torch.__version__, tiny=args.tiny)
    elif args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        device = torch.device("cpu")
        report(device="cpu (Triton's interpreter)", torch=torch.__version__, tiny=True)
    else:
        sys.exit("bench/prefill_tiles.py times GPU kernels: it needs a CUDA device and deepinfer-nvidia-sm100 "
                 "(--tiny runs the sweeps in Triton's interpreter on the CPU)")
    sweeps = {"attention": sweep_attention, "hyper": sweep_hyper, "moe": sweep_moe, "fp4": sweep_fp4}
    for name in args.only.split(","):
        if name not in sweeps:
            sys.exit(f"--only: unknown sweep {name!r}; choose from {', '.join(sweeps)}")
        sweeps[name](device, sizes)
    if device.type == "cuda":
        from bench_results import record

        record("prefill_tiles", POINTS, torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
