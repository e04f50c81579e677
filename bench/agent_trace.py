"""The prefix tiers on an agent trace (`bench/prefix_cache.py --store DIR` runs this).

The trace (seeded): `--agent-sessions` agent sessions (8) share one system prompt; each turn resends the
whole history plus a tool result of 300-1000 tokens, and the greedy answer (32-64 tokens) joins the
history, so by the last of `--agent-turns` turns (36) a history is near 30K tokens. Sessions interleave: each round serves
turn t of every session, `--concurrency` at a time, in a fresh (seeded) order, so a session comes back
after a varying number of others: the device cache (`--device-blocks`, sized to hold a few histories)
has evicted its blocks, which come back from the host tier (`--host-gib`, half the trace: the recent
sessions) or the store (the others).
`--scale` shrinks every length (0.1 for a CPU run).

Modes, one JSON line each: "off" (no prefix cache), "device" (the device cache only), "tiers" (device
+ host + store in `DIR`, wiped first), and "restart": the tiers again, where the engine is rebuilt
halfway (an empty device and host; the store as the first half left it). Per mode: prompt tokens, hit
tokens and input-token hit rate per tier (device / host / store), the ceiling (the share of input
tokens in full blocks sent or answered before: what any cache of 128-token blocks could serve), prefill tokens computed against the
"off" run, wall time, the prefill phase's time (per batch, submission to its last first token: loads
included, the answers' decode not) and the effective prefill throughput (prompt tokens per prefill
second, and its ratio to the "off" run), bytes moved, load waits, and whether every answer equals the
"off" run's (exact replay). "restart" also reports the second
half's hit rate and ceiling alone: what a restarted engine serves from the store. `--modes` picks
modes, in order, repeats allowed: ratios and "equal" are against the latest "off" run (the first mode
run before any), so `off,tiers,restart,off,tiers,restart` measures the second round with every kernel
specialisation of the trace's lengths compiled.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from dataclasses import dataclass

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.layer_plan import BLOCK_SIZE

TIERS = ("device", "host", "store")
MODES = ("off", "device", "tiers", "restart")
WORKLOADS = {
    "tiny": {},
    "wide": {"hidden_size": 1024, "moe_intermediate_size": 512, "num_attention_heads": 16, "q_lora_rank": 512,
             "o_lora_rank": 256, "n_routed_experts": 16, "index_n_heads": 8},
}
"""Overrides of the CPU workload's config (`cpu_throughput.WORKLOAD`) per `--workload`."""
COUNTERS = ("prefix_cache_hit_tokens", "num_prefill_tokens", *(f"prefix_cache_hit_tokens_{t}" for t in TIERS),
            "prefix_store_bytes_read", "prefix_store_bytes_written", "host_cache_bytes_out",
            "prefix_store_load_seconds_total", "prefix_store_loads", "prefix_store_corrupt_blocks",
            "host_cache_evictions", "prefix_cache_replay_tokens")


@dataclass
class AgentTrace:
    system: list[int]
    tools: list[list[list[int]]]
    """tools[session][turn]: the tool result sent with that turn."""
    answer_tokens: list[list[int]]
    orders: list[list[int]]
    """orders[turn]: the order sessions are served in that round (a fresh shuffle each round)."""


def add_arguments(parser) -> None:
    group = parser.add_argument_group("agent trace (with --store)")
    group.add_argument("--store", default=None, help="prefix store directory (wiped): runs the agent trace")
    group.add_argument("--agent-sessions", type=int, default=8)
    group.add_argument("--agent-turns", type=int, default=36,
                       help="turns a session (default 36: histories reach ~30K tokens, and a cache of "
                            "128-token blocks can serve at most 95.2%% of the input tokens)")
    group.add_argument("--concurrency", type=int, default=4, help="sessions served at once")
    group.add_argument("--scale", type=float, default=1.0, help="multiply every length (0.1 for CPU)")
    group.add_argument("--device-blocks", type=int, default=None,
                       help="device cache blocks (default: room for `concurrency` + 1 full histories)")
    group.add_argument("--host-gib", type=float, default=None,
                       help="host tier GiB (default: half the trace's blocks)")
    group.add_argument("--modes", type=lambda text: text.split(","), default=list(MODES),
                       help=f"modes to run in order, comma-separated (default {','.join(MODES)}; repeats "
                            "allowed); ratios are against the latest off run")
    group.add_argument("--device", default="cpu", help='torch device ("cuda" on a GPU)')
    group.add_argument("--deterministic", action="store_true",
                       help="deterministic mode: a cached run's answers then equal the cache-off run's bit for bit "
                            "on a GPU too (default mode's kernels change their reduction order with the batch)")
    group.add_argument("--swa-replay", choices=["exact", "bounded"], default=None,
                       help="how a hit rebuilds the windows (default: the model's, exact for V4); bounded "
                            "recomputes one window a hit, not num_layers of them, and changes V4's answers")
    group.add_argument("--model", default=None, help="checkpoint directory (default: a random model of --workload)")
    group.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny",
                       help="the random model: tiny (the CPU workload, hidden 128) or wide (hidden 1024, 16 "
                            "experts: prefill costs compute on a GPU, so the cache's saving shows in its time)")


def make_agent_trace(args, vocab: int) -> AgentTrace:
    rng = random.Random(args.seed)

    def tokens(low: float, high: float) -> list[int]:
        n = rng.randint(max(1, int(low * args.scale)), max(1, int(high * args.scale)))
        return [rng.randrange(2, vocab) for _ in range(n)]

    system = tokens(1500, 2500)
    tools = [[tokens(300, 1000) for _ in range(args.agent_turns)] for _ in range(args.agent_sessions)]
    answers = [[rng.randint(max(1, int(32 * args.scale)), max(1, int(64 * args.scale))) for _ in range(args.agent_turns)]
               for _ in range(args.agent_sessions)]
    orders = [rng.sample(range(args.agent_sessions), args.agent_sessions) for _ in range(args.agent_turns)]
    return AgentTrace(system, tools, answers, orders)


def longest_history(trace: AgentTrace) -> int:
    return len(trace.system) + max(sum(len(t) for t in tools) + sum(a) for tools, a in zip(trace.tools, trace.answer_tokens))


def serve_turns(llm: LLM, trace: AgentTrace, histories: list[list[int]], answers: list[list[list[int]]],
                turns: range, concurrency: int) -> float:
    """Turns `turns` of every session, interleaved, `concurrency` sessions per batch. Returns the
    prefill phase's seconds: per batch, from its submission to the last of its first tokens (the
    prompts' prefill, loads from the tiers included; the answers' decode after that is not)."""
    prefill_s = 0.0
    for t in turns:
        sessions = trace.orders[t]
        for start in range(0, len(sessions), concurrency):
            batch = list(sessions[start : start + concurrency])
            prompts = [{"prompt_token_ids": histories[s] + trace.tools[s][t]} for s in batch]
            params = [SamplingParams(temperature=0, max_tokens=trace.answer_tokens[s][t], ignore_eos=True,
                                     traffic_class="agent") for s in batch]
            submitted = time.time()  # the clock of RequestMetrics
            outputs = llm.generate(prompts, params, use_tqdm=False)
            prefill_s += max(out.metrics.first_token_time for out in outputs) - submitted
            for s, prompt, out in zip(batch, prompts, outputs):
                answers[s][t] = list(out.outputs[0].token_ids)
                histories[s] = prompt["prompt_token_ids"] + answers[s][t]
    return prefill_s


def counters(llm: LLM) -> dict[str, float]:
    stats = llm.engine.stats()
    return {k: stats.get(k, 0) for k in COUNTERS}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def run_mode(mode: str, trace: AgentTrace, args, options: dict) -> tuple[dict, list]:
    tiers = {}
    if mode != "off":
        tiers["enable_prefix_caching"] = True
    if mode in ("tiers", "restart"):
        shutil.rmtree(args.store, ignore_errors=True)
        tiers |= {"host_cache_gib": options.pop("host_cache_gib"), "prefix_store_path": args.store}
    else:
        options.pop("host_cache_gib")
    histories = [list(trace.system) for _ in trace.tools]
    answers = [[[] for _ in range(args.agent_turns)] for _ in trace.tools]
    halves = [range(args.agent_turns)] if mode != "restart" else [range(args.agent_turns // 2),
                                                                  range(args.agent_turns // 2, args.agent_turns)]
    totals, wall, prefill_s = dict.fromkeys(COUNTERS, 0), 0.0, 0.0
    second_half = None
    for half in halves:
        llm = LLM(**options, **tiers)
        before = counters(llm)
        start = time.perf_counter()
        prefill_s += serve_turns(llm, trace, histories, answers, half, args.concurrency)
        wall += time.perf_counter() - start
        if llm.engine.prefix_tiers is not None:
            llm.engine.prefix_tiers.flush()
        part = delta(counters(llm), before)
        totals = {k: totals[k] + part[k] for k in COUNTERS}
        second_half = part
        llm.engine.shutdown()
        del llm
    row = {"mode": mode, "wall_s": round(wall, 3), "prefill_wall_s": round(prefill_s, 3), **{k: round(v, 4) if isinstance(v, float) else v for k, v in totals.items()}}
    if mode == "restart":
        row["second_half_hit_tokens"] = second_half["prefix_cache_hit_tokens"]
        row["second_half_store_hit_tokens"] = second_half["prefix_cache_hit_tokens_store"]
    return row, answers


def ceiling_tokens(trace: AgentTrace, answers: list[list[list[int]]], turns: range) -> int:
    """Input tokens any cache of 128-token blocks could serve over `turns`: the full blocks of what was
    sent or answered before (a session's previous prompt + answer; on its first turn the system prompt,
    except for the trace's very first request). A prompt's last token is always computed."""
    total = 0
    first = trace.orders[0][0]
    for s, (tools, session_answers) in enumerate(zip(trace.tools, answers)):
        history = len(trace.system) + sum(len(tools[t]) + len(session_answers[t]) for t in range(turns.start))
        for t in turns:
            cached = 0 if (t == 0 and s == first) else history
            history += len(tools[t])
            total += min(cached, history - 1) // BLOCK_SIZE * BLOCK_SIZE
            history += len(session_answers[t])
    return total


def prompt_tokens(trace: AgentTrace, answers: list[list[list[int]]], turns: range) -> int:
    total = 0
    for tools, session_answers in zip(trace.tools, answers):
        history = len(trace.system) + sum(len(tools[t]) + len(session_answers[t]) for t in range(turns.start))
        for t in turns:
            history += len(tools[t])
            total += history
            history += len(session_answers[t])
    return total


def main_agent(args, workload_config, write_checkpoint, git_commit) -> list[dict]:
    import tempfile

    from deepinfer_core.config import ModelConfig
    from deepinfer_core.kv.blocks import block_layout, layout_bytes
    from deepinfer_core.models import registry

    trace = make_agent_trace(args, args.vocab)
    longest = longest_history(trace)
    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix="deepinfer-agent-bench-")
        write_checkpoint(model, {**workload_config(args.vocab), **WORKLOADS[args.workload],
                                 "max_position_embeddings": max(4096, 2 * longest)})
    config = ModelConfig.from_dir(model)
    import torch

    dtype = getattr(torch, args.dtype)
    block_bytes = layout_bytes(block_layout(registry.model_class(config).layer_plan(config, dtype), dtype))
    blocks_per_history = -(-longest // BLOCK_SIZE)
    trace_blocks = sum(-(-(len(trace.system) + sum(map(len, tools)) + sum(a)) // BLOCK_SIZE)
                       for tools, a in zip(trace.tools, trace.answer_tokens))
    device_blocks = args.device_blocks or (args.concurrency + 1) * blocks_per_history
    if device_blocks < args.concurrency * blocks_per_history:
        # a batch's last turns then do not fit at once: some requests wait for others to finish decoding,
        # and the prefill phase times that decode too (measured: 4 sessions at 320 blocks on an H100)
        print(f"note: --device-blocks {device_blocks} holds fewer than --concurrency {args.concurrency} full "
              f"histories ({args.concurrency * blocks_per_history} blocks): late turns of a batch are served "
              "one after another and the prefill phase includes other requests' decode", file=sys.stderr)
    host_gib = args.host_gib if args.host_gib is not None else trace_blocks // 2 * block_bytes / 2**30
    options = {"model": model, "dtype": args.dtype, "max_model_len": longest + 8, "device": args.device,
               "max_num_seqs": args.concurrency, "num_kv_blocks": device_blocks,
               # decode batches never exceed the concurrency: capture only those (each mode builds an engine)
               "cuda_graph_sizes": tuple(range(1, args.concurrency + 1)), "deterministic": args.deterministic,
               **({"swa_replay": args.swa_replay} if args.swa_replay else {})}
    print(json.dumps({"bench": "prefix_cache_agent", "commit": git_commit(), "sessions": args.agent_sessions,
                      "turns": args.agent_turns, "scale": args.scale, "system_tokens": len(trace.system),
                      "longest_history": longest, "device_blocks": device_blocks, "block_bytes": block_bytes,
                      "trace_blocks": trace_blocks, "host_gib": round(host_gib, 6), "device": args.device,
                      "swa_replay": args.swa_replay or "model default",
                      "workload": args.model or args.workload}), flush=True)
    if args.device != "cpu":  # a short trace first: the kernels of every path compile outside the timings
        short = argparse.Namespace(**{**vars(args), "agent_turns": min(4, args.agent_turns)})
        short_trace = make_agent_trace(short, args.vocab)
        for mode in ("off", "device", "tiers"):
            run_mode(mode, short_trace, short, {**options, "host_cache_gib": host_gib})
    rows, cold_answers, cold_wall, cold_prefill_s = [], None, None, None
    for mode in args.modes:
        row, answers = run_mode(mode, trace, args, {**options, "host_cache_gib": host_gib})
        queried = prompt_tokens(trace, answers, range(args.agent_turns))
        if mode == "off" or cold_answers is None:  # later modes compare against the latest "off" run
            cold_answers, cold_wall, cold_prefill_s = answers, row["wall_s"], row["prefill_wall_s"]
            cold_prefill_tokens = row["num_prefill_tokens"]
        row |= {"prompt_tokens": queried, "hit_rate": round(row["prefix_cache_hit_tokens"] / queried, 4),
                "ceiling_hit_rate": round(ceiling_tokens(trace, answers, range(args.agent_turns)) / queried, 4),
                **{f"hit_rate_{t}": round(row[f"prefix_cache_hit_tokens_{t}"] / queried, 4) for t in TIERS},
                "prefill_vs_off": round(row["num_prefill_tokens"] / cold_prefill_tokens, 4),
                "effective_prefill_tok_s": round(queried / row["prefill_wall_s"], 1),
                "effective_prefill_vs_off": round(cold_prefill_s / row["prefill_wall_s"], 3),
                "speedup_vs_off": round(cold_wall / row["wall_s"], 3), "answers_equal_off": answers == cold_answers}
        if mode == "restart":
            second = prompt_tokens(trace, answers, range(args.agent_turns // 2, args.agent_turns))
            row["second_half_hit_rate"] = round(row["second_half_hit_tokens"] / second, 4)
            row["second_half_store_hit_rate"] = round(row["second_half_store_hit_tokens"] / second, 4)
            row["second_half_ceiling_hit_rate"] = round(
                ceiling_tokens(trace, answers, range(args.agent_turns // 2, args.agent_turns)) / second, 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{'mode':8s} {'wall s':>8s} {'prefill s':>9s} {'hit':>7s} {'ceiling':>7s} {'device':>7s} {'host':>7s} {'store':>7s} "
          f"{'prefill/off':>11s} {'eff tok/s':>10s} {'eff/off':>8s} {'equal':>6s}")
    for r in rows:
        print(f"{r['mode']:8s} {r['wall_s']:8.2f} {r['prefill_wall_s']:9.2f} {r['hit_rate']:7.1%} {r['ceiling_hit_rate']:7.1%} "
              f"{r['hit_rate_device']:7.1%} "
              f"{r['hit_rate_host']:7.1%} {r['hit_rate_store']:7.1%} {r['prefill_vs_off']:11.3f} "
              f"{r['effective_prefill_tok_s']:10.0f} {r['effective_prefill_vs_off']:7.2f}x {r['answers_equal_off']!s:>6s}")
    for restart in (r for r in rows if r["mode"] == "restart"):
        print(f"after the restart: {restart['second_half_hit_rate']:.1%} of the input tokens from the cache "
              f"({restart['second_half_store_hit_rate']:.1%} read from the store; a cache of 128-token blocks "
              f"could serve at most {restart['second_half_ceiling_hit_rate']:.1%})")
    return rows
