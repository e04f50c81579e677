"""`deepinfer plan MODEL ...`: what a deployment needs per rank, before loading (or downloading) anything.

Prints, per rank, the weight bytes by kind, the KV cache's bytes per token and per request of
`--max-model-len` tokens, and how many such requests fit in `--gpu-memory-gib`, or which rank does not
fit and by how much (`entrypoints.sizing` computes it). `--json` prints the same as one object. Exit
status 0 when the layout runs and every rank fits, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json

GIB = 2**30


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """`deepinfer plan MODEL [--tensor-parallel-size T] [--data-parallel-size D] [--enable-expert-parallel] ...`."""
    parser = subparsers.add_parser(
        "plan", help="size a deployment per rank (weights, KV cache, requests that fit) without loading weights",
        description="Size a deployment per rank from config.json (and the safetensors headers where a checkpoint "
                    "is present; never the weights). Exit status 0 when it fits, 1 when not.", allow_abbrev=False)
    parser.add_argument("model", metavar="MODEL", help="checkpoint directory, or a config.json file")
    parser.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=1, metavar="T")
    parser.add_argument("--data-parallel-size", "-dp", type=_positive, default=1, metavar="D")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="spread the routed experts over all T x D ranks")
    parser.add_argument("--gpu-memory-gib", type=_positive_float, default=80.0, metavar="G",
                        help="device memory per GPU in GiB (default 80)")
    parser.add_argument("--max-model-len", type=_positive, default=65536, metavar="L",
                        help="tokens per request the cache must hold (default 65536)")
    parser.add_argument("--gpu-memory-utilization", type=_positive_float, default=0.9, metavar="F",
                        help="fraction of the memory left after the weights the cache may take (default 0.9)")
    parser.add_argument("--max-num-seqs", type=_positive, default=256, metavar="N",
                        help="request slots the engine reserves (default 256)")
    parser.add_argument("--engram-placement", choices=("device", "host"), default="device",
                        help="where V4.1's Engram tables live (default device)")
    parser.add_argument("--quantized-weights", choices=("native", "dequantize"), default="native",
                        help="native: FP4 experts and FP8 projections stay packed (default); dequantize: all bf16")
    parser.add_argument("--mtp", action="store_true", help="count the checkpoint's drafter: V4's MTP layer, V4.1's DSpark stages (speculative decoding)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.set_defaults(handler=run_plan)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; 0 when it runs and fits, 1 when not."""
    from deepinfer_core.entrypoints.sizing import Budget, Layout, plan_deployment

    if args.gpu_memory_utilization > 1:
        raise ValueError(f"--gpu-memory-utilization must be at most 1, got {args.gpu_memory_utilization}")
    layout = Layout(args.tensor_parallel_size, args.data_parallel_size, args.enable_expert_parallel)
    budget = Budget(args.gpu_memory_gib, args.max_model_len, args.gpu_memory_utilization, args.max_num_seqs,
                    args.engram_placement, args.mtp, args.quantized_weights)
    plan = plan_deployment(args.model, layout, budget)
    print(json.dumps(plan_json(plan), indent=2) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


def plan_json(plan) -> dict:
    """The plan as one JSON-ready object (per rank `<kind>_bytes`, KV bytes, `fits`; overall `fits`)."""
    from deepinfer_core.entrypoints.sizing import SHARDING_RULES

    layout, budget = plan.layout, plan.budget
    ranks = []
    for rank in plan.ranks:
        row = {"rank": rank.rank, **{f"{kind}_bytes": n for kind, n in rank.device_bytes.items()},
               "weight_bytes": rank.device_weight_bytes,
               "host_bytes": {f"{kind}_bytes": n for kind, n in rank.host_bytes.items() if n},
               "kv_bytes_per_token": rank.kv_bytes_per_block / 128, "kv_bytes_per_block": rank.kv_bytes_per_block,
               "kv_bytes_per_request_slot": rank.kv_bytes_per_slot, "kv_bytes_per_request": rank.kv_bytes_per_request,
               "concurrent_requests": rank.concurrent_requests, "fits": rank.fits}
        if not rank.fits:
            row["shortfall_bytes"] = rank.shortfall_bytes
        ranks.append(row)
    return {
        "model_type": plan.model_type, "tensor_parallel_size": layout.tensor_parallel_size,
        "data_parallel_size": layout.data_parallel_size, "enable_expert_parallel": layout.enable_expert_parallel,
        "gpu_memory_bytes": int(budget.gpu_memory_gib * GIB), "max_model_len": budget.max_model_len,
        "gpu_memory_utilization": budget.gpu_memory_utilization, "max_num_seqs": budget.max_num_seqs,
        "runnable": plan.runnable, "not_runnable_reasons": plan.refusals,
        "sharding_rules": list(SHARDING_RULES) if not plan.runnable else [],
        "ranks": ranks, "concurrent_requests": plan.concurrent_requests if plan.would_fit else 0,
        "would_fit": plan.would_fit, "fits": plan.fits, "notes": plan.notes,
    }


def format_plan(plan) -> str:
    """The plan as plain text: one row per group of identical ranks, then the verdict."""
    from deepinfer_core.entrypoints.sizing import KINDS, SHARDING_RULES

    layout, budget = plan.layout, plan.budget
    lines = [(f"{plan.model_type}: tensor_parallel_size={layout.tensor_parallel_size} "
              f"data_parallel_size={layout.data_parallel_size} enable_expert_parallel={layout.enable_expert_parallel} "
              f"({layout.world_size} ranks), {budget.gpu_memory_gib:g} GiB per GPU, max_model_len={budget.max_model_len}")]
    if not plan.runnable:
        lines += ["NOT RUNNABLE IN THIS BUILD: " + "; ".join(plan.refusals),
                  "sized by these sharding rules (what the layout would need):", *(f"  - {r}" for r in SHARDING_RULES)]
    header = ("ranks", *KINDS, "weights", "host", "KV/token", "KV/request", "requests", "fits")
    rows = []
    for first, last, rank in _groups(plan.ranks):
        rows.append((f"{first}" if first == last else f"{first}-{last}",
                     *(_gib(rank.device_bytes[k]) for k in KINDS), _gib(rank.device_weight_bytes),
                     _gib(sum(rank.host_bytes.values())), f"{rank.kv_bytes_per_block / 128:,.0f} B",
                     f"{rank.kv_bytes_per_request / GIB:.2f} GiB", str(rank.concurrent_requests),
                     "yes" if rank.fits else f"NO: short {rank.shortfall_bytes / GIB:.1f} GiB"))
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines += ["", "  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines += ["", ("weights and host in GiB; KV/request includes the request slot's fixed state "
                   f"({plan.ranks[0].kv_bytes_per_slot / 2**20:.1f} MiB)")]
    lines += [f"note: {note}" for note in plan.notes]
    held = (f"{plan.concurrent_requests} concurrent {budget.max_model_len}-token requests "
            f"({layout.data_parallel_size} x {plan.concurrent_requests // layout.data_parallel_size})")
    if plan.fits:
        lines.append(f"fits: {held}")
    elif plan.would_fit:
        lines.append(f"would fit ({held}), but this build does not run the layout")
    else:
        lines.append(f"does not fit: ranks {[r.rank for r in plan.ranks if not r.fits]} are short of memory")
    return "\n".join(lines)


def _groups(ranks):
    """`(first, last, rank)` runs of consecutive ranks with the same numbers."""
    out = []
    for rank in ranks:
        key = (rank.device_bytes, rank.host_bytes, rank.concurrent_requests, rank.fits)
        if out and out[-1][3] == key:
            out[-1][1] = rank.rank
        else:
            out.append([rank.rank, rank.rank, rank, key])
    return [(first, last, rank) for first, last, rank, _ in out]


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"
