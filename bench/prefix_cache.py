"""Prefix caching on an agent trace: cache off, `swa_replay="bounded"` and `swa_replay="exact"`.

    python bench/prefix_cache.py [--sessions 20] [--turns 8] [--dtype float32] [--threads 1] [--quick]
    python bench/prefix_cache.py --store DIR [--scale 0.1] [--device cuda]   # the prefix tiers, agent trace

With `--store`, the agent trace of `bench/agent_trace.py` runs instead (device cache, host tier and
store, across a restart); its docstring describes it.

The trace (seeded, reproducible; token ids drawn uniformly from the vocabulary): one agent's system
prompt of 200-400 tokens shared by `--sessions` sessions of `--turns` turns. Each turn sends the whole
history plus a new user message (20-60 tokens) and a tool result (30-80 tokens); the model answers
greedily (EOS ignored) with 16-32 tokens, and the answer joins the history for the next turn. All
sessions' turn t run as one `LLM.generate` batch, then turn t+1.

Each mode appends its own answers, as an agent would. Agreement with the cache-off run is measured on
the turns whose prompt is identical to the cache-off prompt (every earlier answer of the session
agreed); answer lengths are fixed, so every mode computes the same number of prompt tokens.

Model: the CPU workload of `cpu_throughput.py` (hidden 128, sliding / CSA / HCA layers, head_dim 512,
window 128, CSA rate 4, HCA rate 128, 64 experts top-6), random weights, vocabulary 32000 by default.

Per mode, one JSON line: wall time and time saved against the cache off, prompt tokens, cache hit
tokens and hit rate, prefill tokens computed, prefill tokens recomputed per hit (the sliding-window
replay: at most the window for "bounded", at most layers x window for "exact"), and agreement with the cache-off
answers on identical prompts: turns compared, the fraction of identical answer tokens, and the largest
difference of a chosen token's logprob while the answers still agree. `ideal_hit_rate` is the best any cache of 128-token blocks could
do on this trace (every full block of the previous turn's prompt + answer hit). A table comes last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import agent_trace
from cpu_throughput import git_commit, workload_config

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.layer_plan import BLOCK_SIZE
from deepinfer_core.testing.checkpoints import write_checkpoint

MODES = (("off", None), ("bounded", "bounded"), ("exact", "exact"))


@dataclass
class Turn:
    user: list[int]
    tool: list[int]
    max_tokens: int


@dataclass
class Trace:
    system: list[int]
    sessions: list[list[Turn]]


@dataclass
class ModeResult:
    wall_s: float
    answers: list[list[list[int]]]
    """answers[session][turn]: generated token ids."""
    logprobs: list[list[list[float]]]
    """The chosen tokens' logprobs, same shape as `answers`."""
    num_hit_requests: int
    stats: dict


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="default float32, where the cache-off and exact-replay answers must match bit for bit")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 under --quick). On a machine shared with busy "
                             "processes more threads spin in OpenMP barriers: use 1 or OMP_WAIT_POLICY=PASSIVE")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 sessions of 3 turns, 1 thread")
    agent_trace.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.turns = 4, 3
        args.agent_sessions, args.agent_turns, args.scale, args.concurrency = 4, 6, 0.05, 2
        args.threads = args.threads or 1
    if args.sessions < 1 or args.turns < 1:
        parser.error("--sessions and --turns must be >= 1")
    unknown = [mode for mode in args.modes if mode not in agent_trace.MODES]
    if unknown or not args.modes:
        parser.error(f"--modes: unknown {unknown}, choose from {','.join(agent_trace.MODES)}")
    return args


def make_trace(num_sessions: int, num_turns: int, vocab: int, seed: int) -> Trace:
    rng = random.Random(seed)

    def tokens(low: int, high: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(rng.randint(low, high))]  # 0, 1: BOS, EOS

    system = tokens(200, 400)
    sessions = [[Turn(tokens(20, 60), tokens(30, 80), rng.randint(16, 32)) for _ in range(num_turns)]
                for _ in range(num_sessions)]
    return Trace(system, sessions)


def ideal_hit_rate(trace: Trace, answers: list[list[list[int]]]) -> float:
    """Hit tokens / prompt tokens if every full block of each turn's cached prefix hit: the system
    prompt's for a session's first turn (after the very first request), else the previous prompt + answer."""
    hits = queried = 0
    for s, turns in enumerate(trace.sessions):
        cached = len(trace.system) if s else 0
        history = list(trace.system)
        for t, turn in enumerate(turns):
            prompt = history + turn.user + turn.tool
            hits += min(cached, len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
            queried += len(prompt)
            history = prompt + answers[s][t]
            cached = len(history)
    return hits / queried


def num_prompt_tokens(trace: Trace, answers: list[list[list[int]]]) -> int:
    total = 0
    for turns, session_answers in zip(trace.sessions, answers):
        history = len(trace.system)
        for turn, answer in zip(turns, session_answers):
            history += len(turn.user) + len(turn.tool)
            total += history
            history += len(answer)
    return total


def run_trace(llm: LLM, trace: Trace) -> ModeResult:
    num_turns = len(trace.sessions[0])
    histories = [list(trace.system) for _ in trace.sessions]
    answers = [[[] for _ in range(num_turns)] for _ in trace.sessions]
    logprobs = [[[] for _ in range(num_turns)] for _ in trace.sessions]
    num_hit_requests = 0
    before = llm.engine.stats()
    start = time.perf_counter()
    for t in range(num_turns):
        turns = [session[t] for session in trace.sessions]
        prompts = [{"prompt_token_ids": h + turn.user + turn.tool} for h, turn in zip(histories, turns)]
        params = [SamplingParams(temperature=0, max_tokens=turn.max_tokens, ignore_eos=True, logprobs=0)
                  for turn in turns]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for s, (prompt, output) in enumerate(zip(prompts, outputs)):
            completion = output.outputs[0]
            answers[s][t] = list(completion.token_ids)
            logprobs[s][t] = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
            num_hit_requests += output.num_cached_tokens > 0
            histories[s] = prompt["prompt_token_ids"] + answers[s][t]
    wall_s = time.perf_counter() - start
    after = llm.engine.stats()
    counters = {k: after[k] - before[k] for k in ("prefix_cache_hit_tokens", "num_prefill_tokens", "num_preemptions")}
    return ModeResult(wall_s, answers, logprobs, num_hit_requests, counters)


def agreement(result: ModeResult, cold: ModeResult) -> dict:
    same = total = turns = 0
    max_diff = 0.0
    for ours_s, cold_s, lp_s, cold_lp_s in zip(result.answers, cold.answers, result.logprobs, cold.logprobs):
        for ours, theirs, lp, cold_lp in zip(ours_s, cold_s, lp_s, cold_lp_s):
            turns += 1
            total += len(theirs)
            same += sum(a == b for a, b in zip(ours, theirs))
            for a, b, x, y in zip(ours, theirs, lp, cold_lp):
                if a != b:
                    break
                max_diff = max(max_diff, abs(x - y))
            if ours != theirs:  # later prompts of this session differ from the cache-off ones
                break
    return {"turns_compared": turns, "token_match": round(same / total, 4), "max_logprob_diff": round(max_diff, 5)}


def report(mode: str, result: ModeResult, cold: ModeResult, prompt_tokens: int) -> dict:
    stats = result.stats
    hit, prefill = stats["prefix_cache_hit_tokens"], stats["num_prefill_tokens"]
    recomputed = prefill - (prompt_tokens - hit)  # prefill beyond the uncached prompt tokens
    return {
        "mode": mode, "wall_s": round(result.wall_s, 3), "time_saved_s": round(cold.wall_s - result.wall_s, 3),
        "time_saved_frac": round(1 - result.wall_s / cold.wall_s, 4), "prompt_tokens": prompt_tokens,
        "hit_tokens": hit, "hit_rate": round(hit / prompt_tokens, 4), "prefill_tokens": prefill,
        "hit_requests": result.num_hit_requests,
        "recomputed_per_hit": round(recomputed / result.num_hit_requests, 1) if result.num_hit_requests else 0.0,
        "num_preemptions": stats["num_preemptions"], **agreement(result, cold),
    }


def print_table(rows: list[dict]) -> None:
    print(f"\n{'mode':8s} {'wall s':>8s} {'saved':>7s} {'hit rate':>9s} {'prefill tok':>12s} "
          f"{'recomp/hit':>11s} {'turns cmp':>10s} {'token match':>12s} {'max |dlogp|':>12s}")
    for r in rows:
        print(f"{r['mode']:8s} {r['wall_s']:8.2f} {r['time_saved_frac']:7.1%} {r['hit_rate']:9.1%} "
              f"{r['prefill_tokens']:12d} {r['recomputed_per_hit']:11.1f} {r['turns_compared']:10d} {r['token_match']:12.4f} "
              f"{r['max_logprob_diff']:12.5f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.store:
        agent_trace.main_agent(args, workload_config, write_checkpoint, git_commit)
        return
    trace = make_trace(args.sessions, args.turns, args.vocab, args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="deepinfer-prefix-bench-"))
    write_checkpoint(workdir, workload_config(args.vocab))
    longest = len(trace.system) + args.turns * (60 + 80 + 32)
    options = {"model": str(workdir), "dtype": args.dtype, "max_model_len": longest + 8, "device": "cpu",
               "max_num_seqs": args.sessions, "num_kv_blocks": 4 * args.sessions * -(-longest // BLOCK_SIZE)}
    print(json.dumps({"bench": "prefix_cache", "date": datetime.date.today().isoformat(), "commit": git_commit(),
                      "machine": f"{platform.machine()} {torch.get_num_threads()} threads", "dtype": args.dtype,
                      "sessions": args.sessions, "turns": args.turns, "seed": args.seed,
                      "system_tokens": len(trace.system), "kv_blocks": options["num_kv_blocks"]}), flush=True)
    rows, cold = [], None
    for mode, replay in MODES:
        caching = {"enable_prefix_caching": replay is not None} | ({"swa_replay": replay} if replay else {})
        llm = LLM(**options, **caching)
        llm.generate([{"prompt_token_ids": trace.system[:16]}], SamplingParams(max_tokens=2), use_tqdm=False)
        result = run_trace(llm, trace)
        cold = cold or result
        row = report(mode, result, cold, num_prompt_tokens(trace, result.answers))
        if mode == "off":
            row["ideal_hit_rate"] = round(ideal_hit_rate(trace, cold.answers), 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del llm
    print_table(rows)


if __name__ == "__main__":
    main()
