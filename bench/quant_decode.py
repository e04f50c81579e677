"""The "v4flash-LxE" workload (bench/gpu_decode.py) with FP4 routed experts against bf16 ones.

    python bench/quant_decode.py [--layers 2] [--experts 256] [--batches 1,64] [--new-tokens 33] [--tiny]

Both engines run the same expert values: random e2m1 codes with power-of-two scales (the weights'
std about 0.02), held packed by one engine (`MoESpec.expert_format == "fp4"`, the checkpoint's own
bytes: half a byte per weight plus one e8m0 scale per 32) and dequantised to bf16 by the other; every
other tensor is the same bf16 tensor in both (FP8 dense projections are not native yet). Each row's
decode floor is computed from the bytes that engine's step actually reads (its own expert bytes), so
`decode_of_floor` of the two rows are fractions of different floors; `step_floor_bytes` says which.
"""

# Timing lambdas are called within the loop iteration that defines them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import dataclasses
import json

import gpu_decode as base
import torch

from deepinfer_core.models import quant

EXPERT_NAMES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


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


def fp4_counts(counts: base.Counts, config) -> base.Counts:
    """`counts` with one routed expert's bytes as FP4 codes and e8m0 scales."""
    params = 3 * config.moe_intermediate_size * config.hidden_size
    return dataclasses.replace(counts, expert_bytes=params // 2 + params // quant.FP4_GROUP_SIZE)


def step_floor_bytes(counts: base.Counts, batch: int, context: int) -> float:
    return batch / base.decode_floor_tok_s(counts, batch, context) * base.BANDWIDTH


def weight_bytes(engine) -> int:
    model = engine.runner.model
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--tiny", action="store_true", help="small config on the CPU (checks the script)")
    parser.add_argument("--commit", default="?")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = base.build_config(args)
    model = base.build_model(config, device, dtype)
    with torch.no_grad():
        packed = random_fp4_experts(model, device)
    dense_weights = dict(model.state_dict())
    fp4_weights = {**{n: t for n, t in dense_weights.items() if not n.endswith(EXPERT_NAMES)}, **packed}
    counts = {"bf16": base.count(model, config)}
    counts["fp4"] = fp4_counts(counts["bf16"], config)
    batches = [int(b) for b in args.batches.split(",")]
    print(json.dumps({"workload": f"v4flash-{args.layers}x{args.experts}", "commit": args.commit,
                      "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                      "torch": torch.__version__}), flush=True)
    engines = {}
    for kind, weights in (("bf16", dense_weights), ("fp4", fp4_weights)):
        engines[kind] = base.build_engine(config, model, device, dtype, max(batches), args.new_tokens,
                                          weights=weights)
        formats = sorted({p.moe.expert_format for p in engines[kind].runner.plans})
        print(json.dumps({"engine": kind, "expert_format": formats,
                          "weight_gib": round(weight_bytes(engines[kind]) / 2**30, 3)}), flush=True)
    prompts = torch.randint(2, config.vocab_size, (max(batches), base.PROMPT_LEN),
                            generator=torch.Generator().manual_seed(1)).tolist()
    tokens = {kind: base.engine_generate(engine, prompts[:1], 8)[0] for kind, engine in engines.items()}
    print(json.dumps({"greedy_tokens_equal_bs1_8": tokens["bf16"] == tokens["fp4"], **tokens}), flush=True)
    rows = []
    context = base.PROMPT_LEN + args.new_tokens // 2
    for batch in batches:
        for kind, engine in engines.items():
            lists = prompts[:batch]
            row = base.measure(f"deepinfer-{kind}", lambda n: base.engine_generate(engine, lists, n), batch,
                               args.new_tokens, counts[kind],
                               steady=lambda: base.steady_decode(engine, lists, args.new_tokens))
            row["step_floor_bytes"] = round(step_floor_bytes(counts[kind], batch, context))
            print(json.dumps({"side": row["side"], "batch": batch, "step_floor_bytes": row["step_floor_bytes"]}))
            rows.append(row)
    base.print_table(rows)


if __name__ == "__main__":
    main()
