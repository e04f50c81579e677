"""The "v4flash-LxE" workload (bench/gpu_decode.py), quantised as DeepSeek ships it, against bf16.

    python bench/quant_decode.py [--layers 2] [--experts 256] [--batches 1,64] [--new-tokens 33] [--tiny]
                                 [--repeats 3] [--no-fp8] [--startup] [--profile BATCHES]

Both engines run the same values: random e2m1 expert codes with power-of-two scales (the weights' std
about 0.02) and, unless `--no-fp8`, the projections DeepSeek ships in FP8 (attention q/kv/o, shared
experts) quantised to e4m3 with 128x128 float32 block scales. The "fp8+fp4" engine (or "fp4") holds
them in those bytes (`MoESpec.expert_format == "fp4"`: half a byte per weight plus one e8m0 scale per
32; `FP8Linear`: one byte per weight plus a float32 scale per tile, run by the `make_linear` backend);
the "bf16" engine holds their dequantised values in bf16. Each row's decode floor is computed from the
bytes that engine's step actually reads, so `decode_of_floor` of the two rows are fractions of
different floors; `step_floor_bytes` says which.

`--startup` instead measures start-up: for each engine, two fresh processes build it and serve one
request, the first with an empty Triton kernel cache (cold), the second with the cache the first left
(warm); each prints `build_s` (engine construction: weights to the device, backends, KV cache, graph
capture), `first_request_s` (one 512-token prompt, one new token) and `ready_s` (their sum). Weights
are handed over in memory, so reading a checkpoint from disk is not included.
"""

# Timing lambdas are called within the loop iteration that defines them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import gpu_decode as base
import torch
from bench_results import record

from deepinfer_core.backends import quant
from deepinfer_core.models.deepseek_v4.layers import FP8Linear

EXPERT_NAMES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
FP8_NAMES = (  # the projections DeepSeek ships in FP8
    "self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_proj.weight",
    "self_attn.o_a_proj.weight", "self_attn.o_b_proj.weight", "compressor.indexer.q_b_proj.weight",
    "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight",
)  # fmt: skip
FP8_BLOCK = (128, 128)


def random_fp4_experts(model, device) -> dict[str, torch.Tensor]:
    """Packed random FP4 experts (internal names, `_scale` beside each), and the model's bf16 expert
    tensors overwritten, expert by expert, with their dequantised values."""
    gen = torch.Generator(device=device).manual_seed(2)
    packed = {}
    for name, param in model.state_dict().items():
        if not name.endswith(EXPERT_NAMES):
            continue
        codes = torch.randint(-128, 128, quant.fp4_packed_shape(param.shape), dtype=torch.int8, device=device,
                              generator=gen)
        exponents = torch.randint(-9, -6, quant.fp4_scale_shape(param.shape), device=device, generator=gen)
        scales = torch.exp2(exponents.float()).to(quant.FP4_SCALE_DTYPE)
        for e in range(param.shape[0]):
            param[e].copy_(quant.dequantize_fp4(codes[e], scales[e]).to(param.dtype))
        packed[name], packed[f"{name}_scale"] = codes, scales
    return packed


def fp8_projections(model) -> dict[str, torch.Tensor]:
    """The FP8 projections' e4m3 values and float32 block scales (`<name>_scale`), and the model's bf16
    tensors overwritten with their dequantised values."""
    quantised = {}
    for name, param in model.state_dict().items():
        if name.endswith(FP8_NAMES):
            values, scale = quant.quantize_fp8(param, FP8_BLOCK)
            param.copy_(quant.dequantize_fp8(values, scale, FP8_BLOCK).to(param.dtype))
            quantised[name], quantised[f"{name}_scale"] = values, scale
    return quantised


def quantised_counts(counts: base.Counts, config, fp8: dict[str, torch.Tensor]) -> base.Counts:
    """`counts` with one routed expert's bytes as FP4 codes and e8m0 scales, and the FP8 projections'
    bytes as e4m3 values and float32 scales."""
    params = 3 * config.moe_intermediate_size * config.hidden_size
    saved = sum(t.numel() * (counts.element_size - 1) for n, t in fp8.items() if not n.endswith("_scale"))
    scales = sum(t.numel() * 4 for n, t in fp8.items() if n.endswith("_scale"))
    return dataclasses.replace(counts, expert_bytes=params // 2 + params // quant.FP4_GROUP_SIZE,
                               dense_bytes=counts.dense_bytes - saved + scales)


def step_floor_bytes(counts: base.Counts, batch: int, context: int) -> float:
    return batch / base.decode_floor_tok_s(counts, batch, context) * base.BANDWIDTH


def weight_bytes(engine) -> int:
    model = engine.runner.model
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def build_weights(args, device, dtype):
    """The model, its config and counts, and each engine's weights (internal names)."""
    config = base.build_config(args)
    model = base.build_model(config, device, dtype)
    with torch.no_grad():
        packed = random_fp4_experts(model, device)
        fp8 = {} if args.no_fp8 else fp8_projections(model)
    dense_weights = dict(model.state_dict())
    kept = {**packed, **fp8}
    quantised = {**{n: t for n, t in dense_weights.items() if f"{n}_scale" not in kept}, **kept}
    kind = "fp4" if args.no_fp8 else "fp8+fp4"
    counts = {"bf16": base.count(model, config)}
    counts[kind] = quantised_counts(counts["bf16"], config, fp8)
    return config, model, counts, {"bf16": dense_weights, kind: quantised}


def startup_child(args) -> None:
    """One engine's start-up in this process (a fresh one, so nothing is warm but the kernel cache)."""
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    config, model, _, weights = build_weights(args, device, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    prompt = torch.randint(2, config.vocab_size, (1, base.PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    engine = base.build_engine(config, model, device, dtype, max(batches), args.new_tokens,
                               weights=weights[args.startup_child])
    built = time.perf_counter()
    base.engine_generate(engine, prompt.tolist(), 1)
    done = time.perf_counter()
    print(json.dumps({"startup": args.startup_child, "build_s": round(built - start, 2),
                      "first_request_s": round(done - built, 2), "ready_s": round(done - start, 2)}), flush=True)


def startup(args, argv: list[str]) -> None:
    """Each engine's start-up, cold then warm Triton cache, each in a fresh process (given this run's argv)."""
    quantised = "fp4" if args.no_fp8 else "fp8+fp4"
    kinds = [quantised if kind == "quant" else kind for kind in args.startup_engines.split(",")]
    forwarded = [a for a in argv if a != "--startup"]
    for kind in kinds:
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
            for label in ("cold", "warm"):
                env = {**os.environ, "TRITON_CACHE_DIR": cache}
                done = subprocess.run([sys.executable, __file__, *forwarded, "--startup-child", kind], env=env,
                                      capture_output=True, text=True, check=False)
                rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
                if done.returncode != 0 or not rows:
                    print(json.dumps({"startup": kind, "cache": label, "error": done.stderr[-2000:]}), flush=True)
                    continue
                timing = next(r for r in rows if "startup" in r)
                graphs = next((r["cuda_graph_batch_sizes"] for r in rows if "cuda_graph_batch_sizes" in r), None)
                print(json.dumps({**timing, "cache": label, "cuda_graph_batch_sizes": graphs}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--tiny", action="store_true", help="small config on the CPU (checks the script)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each TTFT and full generation; the best is kept (default 3)")
    parser.add_argument("--no-fp8", action="store_true", help="keep the dense projections bf16 in both engines")
    parser.add_argument("--startup", action="store_true", help="measure start-up, cold and warm kernel cache")
    parser.add_argument("--startup-engines", default="bf16,quant", help="engines --startup measures")
    parser.add_argument("--startup-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile", default="", metavar="BATCHES",
                        help="each engine's decode steps by kernel at these batch sizes (gpu_decode's profile)")
    parser.add_argument("--commit", default="?")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.startup_child:
        return startup_child(args)
    if args.startup:
        return startup(args, sys.argv[1:] if argv is None else argv)
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config, model, counts, weights = build_weights(args, device, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    print(json.dumps({"workload": f"v4flash-{args.layers}x{args.experts}", "commit": args.commit,
                      "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                      "torch": torch.__version__}), flush=True)
    engines = {}
    for kind, kind_weights in weights.items():
        engines[kind] = base.build_engine(config, model, device, dtype, max(batches), args.new_tokens,
                                          weights=kind_weights, graph_sizes=batches)
        runner = engines[kind].runner
        print(json.dumps({"engine": kind, "expert_format": sorted({p.moe.expert_format for p in runner.plans}),
                          "fp8_projections": sum(isinstance(m, FP8Linear) for m in runner.model.modules()),
                          "linear_backends": sorted({type(b).__name__ for b in runner.linear_backends}),
                          "weight_gib": round(weight_bytes(engines[kind]) / 2**30, 3)}), flush=True)
    prompts = torch.randint(2, config.vocab_size, (max(batches), base.PROMPT_LEN),
                            generator=torch.Generator().manual_seed(1)).tolist()
    tokens = {kind: base.engine_generate(engine, prompts[:1], 8)[0] for kind, engine in engines.items()}
    quant_kind = next(k for k in engines if k != "bf16")
    print(json.dumps({"greedy_tokens_equal_bs1_8": tokens["bf16"] == tokens[quant_kind], **tokens}), flush=True)
    for batch in [int(b) for b in args.profile.split(",") if b]:
        for kind, engine in engines.items():
            base.profile_decode(engine, prompts[:batch], f"{kind}-bs{batch}")
    rows = []
    context = base.PROMPT_LEN + args.new_tokens // 2
    for batch in batches:
        for kind, engine in engines.items():
            lists = prompts[:batch]
            row = base.measure(f"deepinfer-{kind}", lambda n: base.engine_generate(engine, lists, n), batch,
                               args.new_tokens, counts[kind],
                               steady=lambda: base.steady_decode(engine, lists, args.new_tokens),
                               repeats=args.repeats)
            row["step_floor_bytes"] = round(step_floor_bytes(counts[kind], batch, context))
            print(json.dumps({"side": row["side"], "batch": batch, "step_floor_bytes": row["step_floor_bytes"]}))
            rows.append(row)
    base.print_table(rows)
    if device == "cuda":
        record("quant_decode", [{"workload": f"v4flash-{args.layers}x{args.experts}", "fp8": not args.no_fp8, **row}
                                for row in rows], torch.cuda.get_device_name(), args.commit)


if __name__ == "__main__":
    main()
