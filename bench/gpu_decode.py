"""The "v4flash-LxE" GPU workload (shared/BENCH.md): DeepInfer's engine against transformers' `generate`.

    python bench/gpu_decode.py [--layers 2] [--experts 256] [--batches 1,16,64,256] [--new-tokens 33]
        [--repeats 3] [--eager] [--parity 8] [--profile 1,64] [--profile-prefill 16] [--model v41]
        [--deterministic] [--engram-placement device|host] [--engram-sync]

DeepSeek-V4-Flash per-layer shapes, `--layers` layers alternating CSA/HCA, `--experts` routed experts,
random weights (normal, std 0.02; random hash tables), bf16, 512-token random prompts, greedy with
`ignore_eos`. Both sides run on the same weight tensors in one process: transformers 5.23
`DeepseekV4ForCausalLM.generate` with experts implementation `grouped_mm`, and DeepInfer's `Engine`
(whatever backends the plugins choose; on an H200 the nvidia_sm100 plugin's).

Per batch size: TTFT (a 1-token request: prefill plus the first token), prefill tokens/s, decode
tokens/s (new tokens after the first over the time they add; each the best of `--repeats` runs) and peak memory; each throughput also as a
fraction of its floor, computed from the counts below: decode is memory-bound (bytes a step touches /
4.17 TB/s), prefill compute-bound (FLOPs / 744 TFLOP/s). `--tiny` runs a small config on the CPU to
check the script itself. Our decode steps replay CUDA graphs when every backend supports them (`--eager`
turns that off); `--parity` compares their greedy tokens with eager decode, `--profile` prints the
device time of decode steps by kernel (graphs and eager), `--profile-prefill` that of a prefill.
`--deterministic` also measures a second engine in deterministic mode (`EngineConfig.deterministic`) at
each batch size, prints its decode and prefill throughput as fractions of the default engine's (target:
decode >= 0.8), and checks that a request's greedy tokens are the same alone and inside the largest batch.
"""

# Timing lambdas are called within the loop iteration that defines them.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import tempfile
import time
import traceback

import torch

BANDWIDTH = 4.17e12
MATMUL_FLOPS = 744e12
PROMPT_LEN = 512


@dataclasses.dataclass
class Counts:
    """What one step reads or computes, from the model's own parameter sizes."""

    dense_bytes: int
    """Every parameter read each step: attention, norms, hc, routers, shared experts, lm_head."""
    expert_bytes: int
    """One routed expert's gate_up + down."""
    dense_flops_per_token: int
    """2 x parameters a token multiplies (embedding and lm_head excluded)."""
    lm_head_flops: int
    num_layers: int
    num_experts: int
    top_k: int
    head_dim: int
    num_heads: int
    layer_rates: list[int]
    index_topk: int
    index_head_dim: int
    element_size: int


def count(model, config) -> Counts:
    size = {}
    for name, p in model.named_parameters():
        kind = (
            "experts"
            if ".mlp.experts." in name
            else "embed"
            if "embed_tokens" in name
            else ("lm_head" if name.startswith("lm_head") else "dense")
        )
        size[kind] = size.get(kind, 0) + p.numel() * p.element_size()
    elem = next(model.parameters()).element_size()
    expert_params = 3 * config.moe_intermediate_size * config.hidden_size
    rates = [config.compress_rates.get(t, 0) for t in config.layer_types]
    dense_params = size["dense"] // elem  # attention, routers, shared experts, norms, hc
    per_token_params = dense_params + config.num_hidden_layers * config.num_experts_per_tok * expert_params
    return Counts(
        dense_bytes=size["dense"] + size["lm_head"],
        expert_bytes=expert_params * elem,
        dense_flops_per_token=2 * per_token_params,
        lm_head_flops=2 * size["lm_head"] // elem,
        num_layers=config.num_hidden_layers,
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        head_dim=config.head_dim,
        num_heads=config.num_attention_heads,
        layer_rates=rates,
        index_topk=config.index_topk,
        index_head_dim=config.index_head_dim,
        element_size=elem,
    )


def expected_touched(counts: Counts, num_tokens: int) -> float:
    """Expected distinct experts of one layer when `num_tokens` tokens each pick `top_k` at random."""
    e, k = counts.num_experts, counts.top_k
    return e * (1 - (1 - k / e) ** num_tokens)


def decode_floor_tok_s(counts: Counts, batch: int, context: int) -> float:
    kv = 0
    for rate in counts.layer_rates:
        entries = context // rate if rate else 0
        read = 128 + (min(entries, counts.index_topk) if rate == 4 else entries)
        kv += read * counts.head_dim + (entries * counts.index_head_dim if rate == 4 else 0)
    step_bytes = (
        counts.dense_bytes
        + counts.num_layers * expected_touched(counts, batch) * counts.expert_bytes
        + batch * kv * counts.element_size
    )
    return batch / (step_bytes / BANDWIDTH)


def prefill_floor_tok_s(counts: Counts, batch: int) -> float:
    attention = 0
    for rate in counts.layer_rates:  # mean keys per query over a 512-token prompt
        entries = PROMPT_LEN / 2 / rate if rate else 0
        keys = min(128, PROMPT_LEN / 2) + (min(entries, counts.index_topk) if rate else 0)
        attention += 4 * counts.num_heads * counts.head_dim * keys
        if rate == 4:
            attention += 2 * 64 * counts.index_head_dim * entries
    flops = batch * PROMPT_LEN * (counts.dense_flops_per_token + attention) + batch * counts.lm_head_flops
    return batch * PROMPT_LEN / (flops / MATMUL_FLOPS)


def build_config(args):
    from transformers import DeepseekV4Config

    kinds = ["compressed_sparse_attention", "heavily_compressed_attention"]
    shape = {
        "vocab_size": 129280,
        "hidden_size": 4096,
        "moe_intermediate_size": 2048,
        "num_attention_heads": 64,
        "head_dim": 512,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
    }
    if args.tiny:
        shape = {
            "vocab_size": 1000,
            "hidden_size": 128,
            "moe_intermediate_size": 64,
            "num_attention_heads": 16,
            "head_dim": 64,
            "q_lora_rank": 64,
            "o_groups": 2,
            "o_lora_rank": 32,
            "index_n_heads": 4,
            "index_head_dim": 32,
            "index_topk": 16,
        }
    return DeepseekV4Config(
        num_hidden_layers=args.layers,
        layer_types=[kinds[i % 2] for i in range(args.layers)],
        n_routed_experts=args.experts,
        num_experts_per_tok=6,
        sliding_window=128,
        initializer_range=0.02,
        num_nextn_predict_layers=0,
        eos_token_id=1,
        bos_token_id=0,
        **shape,
    )


def build_model(config, device, dtype):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV4ForCausalLM._from_config(config, dtype=dtype, experts_implementation="grouped_mm")
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):  # hash layers: random distinct experts per token id
                gate.tid2eid.copy_(
                    torch.rand(config.vocab_size, config.n_routed_experts).argsort(-1)[
                        :, : config.num_experts_per_tok
                    ]
                )
    return model.eval()


def timed(fn) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def hf_generate(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            prompts,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            attention_mask=torch.ones_like(prompts),
            pad_token_id=0,
        )[:, prompts.shape[1] :]


def engine_outputs(engine, prompts: list[list[int]], new_tokens: int) -> list:
    """Each prompt's finished `RequestOutput` (greedy, `new_tokens` tokens), in order."""
    from deepinfer_core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    ids = []
    for prompt in prompts:
        ids.append(f"r{engine_generate.counter}")
        engine_generate.counter += 1
        engine.add_request(ids[-1], prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return [done[i] for i in ids]


def engine_generate(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in engine_outputs(engine, prompts, new_tokens)]


engine_generate.counter = 0


def steady_decode(
    engine, prompts: list[list[int]], new_tokens: int, max_steps: int = 16
) -> tuple[float, int]:
    """Decode tokens/s over the steps in which every request of the batch decodes (after the last prefill
    chunk, before the first request finishes), and how many such steps were timed. Chunked prefill
    staggers the requests, so `full - ttft` also counts steps that carry prefill chunks or a partial
    batch; transformers' `generate` prefills the whole batch in one forward and has no such steps."""
    from deepinfer_core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(f"r{engine_generate.counter}", prompt, params)
        engine_generate.counter += 1
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.is_prefill for s in scheduler.running):
        engine.step()
    engine.step()
    steps = 0
    sync()
    start = time.perf_counter()
    while len(scheduler.running) == len(prompts) and steps < max_steps:
        engine.step()
        steps += 1
    sync()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return (len(prompts) * steps / elapsed if steps else float("nan")), steps


def measure(name: str, run, batch: int, new_tokens: int, counts: Counts, steady=None, repeats: int = 3) -> dict:
    """TTFT from a 1-token run, decode from the time `new_tokens - 1` more tokens add (each run the best
    of `repeats`; and, given `steady`, decode over steps where the whole batch decodes)."""
    run(new_tokens)  # warm-up at this batch size: prefill and decode kernels compile, allocator grows
    peak_reset()
    # the best of several of each: decode time is a difference of two runs, so one slow run skews it
    ttft = min(timed(lambda: run(1)) for _ in range(repeats))
    full = min(timed(lambda: run(new_tokens)) for _ in range(repeats))
    decode_s = max(full - ttft, 1e-9)
    prefill = batch * PROMPT_LEN / ttft
    decode = batch * (new_tokens - 1) / decode_s
    row = {
        "side": name,
        "batch": batch,
        "ttft_s": round(ttft, 4),
        "prefill_tok_s": round(prefill, 1),
        "decode_tok_s": round(decode, 1),
        "peak_gib": round(peak_gib(), 2),
        "prefill_of_floor": round(prefill / prefill_floor_tok_s(counts, batch), 4),
        "decode_of_floor": round(decode / decode_floor_tok_s(counts, batch, PROMPT_LEN + new_tokens // 2), 4),
    }
    if steady is not None:
        tok_s, steps = steady()
        row["steady_decode_tok_s"] = round(tok_s, 1)
        row["steady_steps"] = steps
        floor = decode_floor_tok_s(counts, batch, PROMPT_LEN + new_tokens // 2)
        row["steady_decode_of_floor"] = round(tok_s / floor, 4)
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--sides", default="transformers,deepinfer",
                        help='V4: which of transformers,deepinfer run; --model v41: "v41" skips the V4 peer')
    parser.add_argument("--tiny", action="store_true", help="small config on the CPU (checks the script)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each TTFT and full generation; the best is kept (default 3)")
    parser.add_argument("--commit", default="?", help="recorded in the output")
    parser.add_argument(
        "--profile", default="", metavar="BATCHES", help="profile our decode steps at these batch sizes"
    )
    parser.add_argument("--profile-prefill", type=int, default=0, metavar="BATCH", help="profile our prefill")
    parser.add_argument(
        "--parity",
        type=int,
        default=0,
        metavar="BATCH",
        help="greedy tokens of the engine with CUDA-graph decode against the same engine run eagerly",
    )
    parser.add_argument("--eager", action="store_true", help="never capture CUDA graphs (enforce_eager)")
    parser.add_argument("--deterministic", action="store_true",
                        help="also measure deterministic (batch-invariant) mode against the default engine")
    parser.add_argument(
        "--sync-steps", action="store_true", help="no overlapped decode (async_scheduling=False)"
    )
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="our per-step token budget (default: the engine's)",
    )
    parser.add_argument("--model", choices=["v4", "v41"], default="v4",
                        help='"v41": the v41flash-LxE workload against our V4 path (bench/v41_workload.py)')
    parser.add_argument("--engram-placement", choices=["device", "host"], default="device",
                        help="--model v41: where the Engram table lives (EngineConfig.engram_placement)")
    parser.add_argument("--engram-sync", action="store_true",
                        help="--model v41 with host tables: gather at the layer, no prefetch (engram_prefetch=False)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.model != "v41" and (args.engram_placement != "device" or args.engram_sync):
        parser.error("--engram-placement and --engram-sync are for --model v41 (V4 has no Engram)")
    if args.model == "v41":
        from v41_workload import run_v41

        device_name = "cpu" if args.tiny else torch.cuda.get_device_name()
        run_v41(args, {"date": datetime.date.today().isoformat(), "device": device_name, "commit": args.commit,
                       "torch": torch.__version__, "new_tokens": args.new_tokens, "prompt_len": PROMPT_LEN,
                       "eager": args.eager, "engram_placement": args.engram_placement,
                       "engram_prefetch": not args.engram_sync})
        return
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = build_config(args)
    model = build_model(config, device, dtype)
    counts = count(model, config)
    batches = [int(b) for b in args.batches.split(",")]
    header = {
        "workload": f"v4flash-{args.layers}x{args.experts}",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "commit": args.commit,
        "torch": torch.__version__,
        "new_tokens": args.new_tokens,
        "prompt_len": PROMPT_LEN,
        "eager": args.eager,
        "max_batched_tokens": args.max_batched_tokens,
    }
    print(json.dumps(header), flush=True)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, config.vocab_size, (max(batches), PROMPT_LEN), generator=gen)
    rows = []
    sides = args.sides.split(",")
    engine = (
        build_engine(
            config, model, device, dtype, max(batches), args.new_tokens, args.eager, args.max_batched_tokens,
            False if args.sync_steps else None, graph_sizes=batches,
        )
        if "deepinfer" in sides
        else None
    )
    deterministic = (
        build_engine(config, model, device, dtype, max(batches), args.new_tokens, args.eager,
                     args.max_batched_tokens, False if args.sync_steps else None, deterministic=True,
                     graph_sizes=batches)
        if args.deterministic and engine is not None
        else None
    )
    for batch in batches:
        batch_prompts = prompts[:batch]
        if "transformers" in sides:
            dev_prompts = batch_prompts.to(device)
            rows.append(
                measure(
                    "transformers",
                    lambda n: hf_generate(model, dev_prompts, n),
                    batch,
                    args.new_tokens,
                    counts,
                    repeats=args.repeats,
                )
            )
        if engine is not None:
            lists = batch_prompts.tolist()
            rows.append(
                measure(
                    "deepinfer",
                    lambda n: engine_generate(engine, lists, n),
                    batch,
                    args.new_tokens,
                    counts,
                    steady=lambda: steady_decode(engine, lists, args.new_tokens),
                    repeats=args.repeats,
                )
            )
        if deterministic is not None:
            rows.append(measure("deepinfer-deterministic", lambda n: engine_generate(deterministic, lists, n),
                                batch, args.new_tokens, counts,
                                steady=lambda: steady_decode(deterministic, lists, args.new_tokens),
                                repeats=args.repeats))
    if engine is not None and "transformers" in sides:
        ours = engine_generate(engine, prompts[:1].tolist(), 8)[0]
        theirs = hf_generate(model, prompts[:1].to(device), 8)[0].tolist()
        print(
            json.dumps(
                {"greedy_tokens_equal_bs1_8": ours == theirs, "deepinfer": ours, "transformers": theirs}
            )
        )
    if deterministic is not None:
        deterministic_summary(rows, deterministic, prompts[: max(batches)].tolist(), min(16, args.new_tokens))
    print_table(rows)
    profile_batches = [int(b) for b in args.profile.split(",") if b]
    eager = None
    if engine is not None and (args.parity or (profile_batches and deterministic is None)):
        eager_batch = max([args.parity, *profile_batches])
        eager = build_engine(config, model, device, dtype, eager_batch, args.new_tokens, True)
    if args.parity:
        graph_parity(engine, eager, prompts[: args.parity].tolist(), min(16, args.new_tokens))
    for batch in profile_batches if engine is not None else []:
        label = "graphs" if engine.runner.graphs else "eager"
        profile_decode(engine, prompts[:batch].tolist(), label)
        if deterministic is not None:  # against deterministic mode's kernels instead of eager
            profile_decode(deterministic, prompts[:batch].tolist(), "deterministic")
        else:
            profile_decode(eager, prompts[:batch].tolist(), "eager")
    if engine is not None and args.profile_prefill:
        profile_prefill(engine, prompts[: args.profile_prefill].tolist())


def build_engine(
    config,
    model,
    device: str,
    dtype: torch.dtype,
    max_batch: int,
    new_tokens: int,
    enforce_eager: bool = False,
    max_batched_tokens: int | None = None,
    async_scheduling: bool | None = None,
    weights: dict | None = None,
    speculative_config: dict | None = None,
    deterministic: bool = False,
    graph_sizes: list[int] | None = None,
):
    """The engine on the transformers model's own tensors (no second copy of the weights), or on
    `weights` (internal names) when given; `graph_sizes`: the decode batch sizes captured as CUDA graphs
    (None: the engine's ladder up to `max_batch`; the measured sizes alone start much faster)."""
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.engine import Engine

    directory = tempfile.mkdtemp(prefix="v4flash-")
    config.save_pretrained(directory)
    blocks_per_seq = math.ceil((PROMPT_LEN + new_tokens + 8) / 128)
    engine_config = EngineConfig(
        model=directory,
        dtype="float32" if dtype == torch.float32 else "bfloat16",
        device=device,
        max_num_seqs=max_batch,
        max_model_len=PROMPT_LEN + new_tokens + 8,
        num_kv_blocks=2 * max_batch * blocks_per_seq + 8,
        enforce_eager=enforce_eager,
        max_num_batched_tokens=max_batched_tokens,
        async_scheduling=async_scheduling,
        speculative_config=speculative_config,
        deterministic=deterministic,
        cuda_graph_sizes=tuple(sorted(set(graph_sizes))) if graph_sizes else None,
    )
    weights = dict(model.state_dict()) if weights is None else weights
    start = time.perf_counter()
    try:
        engine = Engine(engine_config, weights=weights)
    except RuntimeError:  # graph capture failed: say where, then measure eagerly
        print(json.dumps({"capture_error": traceback.format_exc()}), flush=True)
        engine_config = engine_config.model_copy(update={"enforce_eager": True})
        engine = Engine(engine_config, weights=weights)
    build_s = time.perf_counter() - start  # graph capture included
    net = engine.runner.model
    names = lambda objs: sorted({type(o).__name__ for o in objs})
    print(
        json.dumps(
            {
                "backends": {
                    "attention": names(net.attention_backends),
                    "moe": names(net.moe_backends),
                    "sampler": type(engine.runner.sampler).__name__,
                    "linear": names(engine.runner.linear_backends),
                },
                "cuda_graph_batch_sizes": engine.runner.graphs.sizes if engine.runner.graphs else None,
                "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                "async_scheduling": engine.steps.overlap,
                "build_s": round(build_s, 2),
            }
        ),
        flush=True,
    )
    return engine


def deterministic_summary(rows: list[dict], engine, prompts: list[list[int]], new_tokens: int) -> None:
    """Per batch, deterministic throughput over default; and the first prompt's greedy tokens alone and
    inside the whole batch (they must be equal in deterministic mode)."""
    by_side = {(r["side"], r["batch"]): r for r in rows}
    for (side, batch), row in by_side.items():
        default = by_side.get(("deepinfer", batch))
        if side != "deepinfer-deterministic" or default is None:
            continue
        ratio = {key: round(row[key] / default[key], 4) for key in ("decode_tok_s", "prefill_tok_s", "steady_decode_tok_s")
                 if row.get(key) and default.get(key)}
        print(json.dumps({"deterministic_over_default": ratio, "batch": batch, "target_decode": ">= 0.8"}), flush=True)
    model = engine.runner.model
    serving = sorted({type(b).__name__ for b in [*model.attention_backends, *model.moe_backends, model.ops]})
    print(json.dumps({"deterministic_backends": serving, "deterministic_graphs": engine.runner.graphs is not None}),
          flush=True)
    alone = engine_generate(engine, prompts[:1], new_tokens)[0]
    batched = engine_generate(engine, prompts, new_tokens)[0]
    print(json.dumps({"deterministic_alone_equals_batched": alone == batched, "batch": len(prompts)}), flush=True)


def profile_decode(engine, prompts: list[list[int]], label: str, steps: int = 4, tokens_per_step: int = 1) -> None:
    """Device time of `steps` decode steps by kernel (after the prefill and one decode step), and the
    wall time a step takes; `tokens_per_step`: tokens a step emits per request (speculative decoding)."""
    from torch.profiler import ProfilerActivity, profile

    from deepinfer_core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=(steps + 2) * tokens_per_step + 2, temperature=0, ignore_eos=True)
    ids = [f"profile-{label}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.is_prefill for s in scheduler.running):
        engine.step()
    engine.step()  # one decode step before the profiled ones
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = (time.perf_counter() - start) / steps
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in events) / steps
    print(
        json.dumps(
            {
                "profile": label,
                "batch": len(prompts),
                "step_wall_ms": round(wall * 1e3, 3),
                "step_device_ms": round(total_us / 1e3, 3),
            }
        ),
        flush=True,
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        share = e.self_device_time_total / max(total_us * steps, 1e-9)
        print(
            f"  {e.self_device_time_total / steps / 1e3:8.3f} ms {share:6.1%} x{e.count // steps:<4d} {e.key[:90]}"
        )
    while engine.has_unfinished_requests():
        engine.step()


def profile_prefill(engine, prompts: list[list[int]]) -> None:
    """Where a prefill's device time goes, by kernel."""
    from torch.profiler import ProfilerActivity, profile

    engine_generate(engine, prompts, 1)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine_generate(engine, prompts, 1)
        sync()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in events)
    print(
        json.dumps(
            {
                "profile": "prefill",
                "batch": len(prompts),
                "wall_ms": round(wall * 1e3, 3),
                "device_ms": round(total_us / 1e3, 3),
            }
        ),
        flush=True,
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(
            f"  {e.self_device_time_total / 1e3:8.3f} ms {e.self_device_time_total / total_us:6.1%} "
            f"x{e.count:<5d} {e.key[:90]}"
        )
    print(json.dumps(device_gaps(prof)), flush=True)
    if torch.cuda.is_available():
        syncs = host_syncs(lambda: engine_generate(engine, prompts, 1))
        print(json.dumps({"prefill_host_syncs": syncs}), flush=True)


def device_gaps(prof, top: int = 8) -> dict:
    """When the device sat idle in a profile: before its first kernel (after the first host op began),
    between kernels (the `top` longest gaps, with the kernels on either side) and after its last."""
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    host = [e.time_range for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    if not kernels or not host:
        return {"device_gaps": "no kernels or host ops recorded"}
    gaps, busy_until = [], kernels[0][1]
    for (start, end, name), (_, _, before) in zip(kernels[1:], kernels):
        if start > busy_until:
            gaps.append((start - busy_until, before, name))
        busy_until = max(busy_until, end)
    gaps.sort(reverse=True)
    return {
        "device_gaps": "prefill",
        "before_first_kernel_ms": round((kernels[0][0] - min(r.start for r in host)) / 1e3, 3),
        "between_kernels_ms": round(sum(g for g, _, _ in gaps) / 1e3, 3),
        "after_last_kernel_ms": round((max(r.end for r in host) - busy_until) / 1e3, 3),
        "longest": [[round(g / 1e3, 3), before[:40], after[:40]] for g, before, after in gaps[:top]],
    }


def host_syncs(run) -> dict[str, int]:
    """Where `run` makes the host wait for the device (torch's sync debug mode), by call site."""
    import collections
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "deepinfer" in f.filename]
        sites[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames[::-1][:3])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode(1)
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return dict(sites.most_common(20))


def graph_parity(engine, eager, prompts: list[list[int]], new_tokens: int) -> None:
    """Greedy tokens of CUDA-graph decode against eager decode of the same engine configuration, on
    prompts cut to different lengths (so requests close compressed windows at different steps)."""
    cut = [p[: len(p) - 37 * i % len(p)] or p[:1] for i, p in enumerate(prompts)]
    ours, theirs = engine_generate(engine, cut, new_tokens), engine_generate(eager, cut, new_tokens)
    mismatched = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    row = {
        "graph_vs_eager_tokens_equal": not mismatched,
        "batch": len(cut),
        "new_tokens": new_tokens,
        "graphs": engine.runner.graphs is not None,
        "mismatched_requests": mismatched,
    }
    if mismatched:
        a, b = ours[mismatched[0]], theirs[mismatched[0]]
        row["first_mismatch"] = {"graphs": a, "eager": b}
    print(json.dumps(row), flush=True)


def print_table(rows: list[dict]) -> None:
    print(
        f"{'side':13s} {'batch':>5s} {'TTFT s':>8s} {'prefill tok/s':>14s} {'of floor':>9s} "
        f"{'decode tok/s':>13s} {'of floor':>9s} {'steady tok/s':>13s} {'of floor':>9s} {'peak GiB':>9s}"
    )
    for r in rows:
        steady = r.get("steady_decode_tok_s", float("nan")), r.get("steady_decode_of_floor", float("nan"))
        print(
            f"{r['side']:13s} {r['batch']:5d} {r['ttft_s']:8.3f} {r['prefill_tok_s']:14.1f} "
            f"{r['prefill_of_floor']:9.4f} {r['decode_tok_s']:13.1f} {r['decode_of_floor']:9.4f} "
            f"{steady[0]:13.1f} {steady[1]:9.4f} {r['peak_gib']:9.2f}"
        )


if __name__ == "__main__":
    main()
