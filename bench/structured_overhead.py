"""Structured output's cost in a decode step: a batch with half its rows constrained by a JSON schema
against the same batch unconstrained.

    python bench/structured_overhead.py [--layers 2] [--experts 256] [--batch 64] [--steps 16] [--tiny]

GPU: the "v4flash-LxE" workload of bench/gpu_decode.py (random weights, bf16, 512-token prompts; the
DeepSeek tokenizer from the recipe plugin indexes the 129,280-id vocabulary for xgrammar). `--tiny`: the
embedded tiny model (real tokenizer, random weights) on the CPU, decode overlapped as on CUDA, to check
the script.

Both runs decode greedily; the schema (an object holding an array of at least 100 integers) keeps the
constrained rows going through the timed steps. Reported: the steady step time of each run (steps in
which every request decodes), the overhead `(constrained - plain) / plain`, the host time a step spends
filling bitmasks and advancing matchers (`StructuredOutputManager.next_token_bitmask`, `accept_many` and `accept`; with
overlapped decode in one process that work runs while the step's forward is on the device), the host's
wait for each step's tokens (`host_wait`: near 0 when the host, not the device, sets the pace), and the
tokens a step yields for constrained and unconstrained rows (1.0 for both: a constrained row's mask is
filled once its step is launched; with worker processes it would need its last token on the host first,
and decode every other step). Target: overhead < 5% of step time.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import time
from contextlib import contextmanager

import gpu_decode as base
import torch

SCHEMA = {
    "type": "object",
    "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 100}},
    "required": ["values"],
}


def build_engine(args):
    """The engine under test and the prompt length its requests use."""
    if not args.tiny:
        config = base.build_config(args)
        model = base.build_model(config, "cuda", torch.bfloat16)
        new_tokens = 2 * args.steps + 16
        sizes = [max(1, args.batch // 2), args.batch]  # the half batch: constrained rows sitting a step out (workers)
        return (base.build_engine(config, model, "cuda", torch.bfloat16, args.batch, new_tokens, graph_sizes=sizes),
                base.PROMPT_LEN)
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.engine import Engine
    from deepinfer_core.models.tiny import embedded_tiny_model_dir

    config = EngineConfig(model=str(embedded_tiny_model_dir()), device="cpu", max_num_seqs=args.batch,
                          max_model_len=512, num_kv_blocks=4 * args.batch + 8, async_scheduling=True)  # as on CUDA
    return Engine(config), 32


@contextmanager
def grammar_timers(engine):
    """Host seconds spent in the structured-output manager's per-step calls, accumulated in a dict."""
    manager, spent = engine.structured_output, {"next_token_bitmask": 0.0, "accept_many": 0.0, "accept": 0.0}
    originals = {name: getattr(manager, name) for name in spent}

    def timed(name):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return originals[name](*a, **k)
            finally:
                spent[name] += time.perf_counter() - start
        return call

    for name in spent:
        setattr(manager, name, timed(name))
    event_sync = torch.cuda.Event.synchronize
    spent["host_wait"] = 0.0  # the host waiting for a step's tokens: ~0 when the host is the bottleneck

    def waited(event):
        start = time.perf_counter()
        try:
            return event_sync(event)
        finally:
            spent["host_wait"] += time.perf_counter() - start

    torch.cuda.Event.synchronize = waited
    try:
        yield spent
    finally:
        torch.cuda.Event.synchronize = event_sync
        for name in originals:
            delattr(manager, name)


def fill_sweep(engine, seq_ids: list[str], repeats: int = 50) -> dict:
    """Milliseconds to fill the masks of `seq_ids` (constrained sequences, in the states the run left
    them) in one call of xgrammar's batch matcher on 1, 2, 4 and 8 threads, and one row at a time."""
    import xgrammar as xgr

    manager = engine.structured_output
    matchers = [manager._seqs[i].matcher for i in seq_ids if i in manager._seqs]
    bitmask = xgr.allocate_token_bitmask(len(matchers), manager.vocab_size)
    rows = list(range(len(matchers)))

    def timed(fill) -> float:
        fill()
        start = time.perf_counter()
        for _ in range(repeats):
            fill()
        return round(1e3 * (time.perf_counter() - start) / repeats, 4)

    result = {"rows": len(matchers)}
    for threads in (1, 2, 4, 8):
        batch = xgr.BatchGrammarMatcher(max_threads=threads)
        result[f"batch_{threads}_threads_ms"] = timed(
            lambda b=batch: b.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows))
    result["row_by_row_ms"] = timed(lambda: [m.fill_next_token_bitmask(bitmask, r) for r, m in enumerate(matchers)])
    return result


def steady_steps(engine, prompts: list[list[int]], constrained: int, steps: int, profile_host: bool = False,
                 sweep: bool = False) -> dict:
    """Time `steps` decode steps in which every request decodes; the first `constrained` rows follow SCHEMA
    (`profile_host`: print a cProfile top 15 of the timed steps' host time; `sweep`: time the mask fill of
    the constrained rows' final states on several thread counts, see `fill_sweep`)."""
    from deepinfer_core.sampling_params import SamplingParams, StructuredOutputsParams

    plain = SamplingParams(max_tokens=4 * steps + 32, temperature=0, ignore_eos=True)
    shaped = SamplingParams(max_tokens=4 * steps + 32, temperature=0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    ids = []
    for i, prompt in enumerate(prompts):
        ids.append(f"s{base.engine_generate.counter}")
        base.engine_generate.counter += 1
        engine.add_request(ids[-1], prompt, shaped if i < constrained else plain)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.is_prefill for s in scheduler.running):
        engine.step()
    engine.step()
    before = {s.request_id: s.num_tokens for s in scheduler.running}
    profiler = cProfile.Profile() if profile_host else None
    with grammar_timers(engine) as spent:
        base.sync()
        start = time.perf_counter()
        done = 0
        if profiler is not None:
            profiler.enable()
        while len(scheduler.running) == len(prompts) and done < steps:
            engine.step()
            done += 1
        base.sync()
        elapsed = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
            print(text.getvalue(), flush=True)
    gained = {s.request_id: s.num_tokens - before[s.request_id] for s in scheduler.running}
    # what a constrained row wrote (the matcher states its masks were filled in)
    sample = next((engine.tokenizer.decode([t for t in s.output_token_ids if t >= 0])[-160:]
                   for s in scheduler.running if s.request_id == ids[0]), None) if constrained else None
    swept = fill_sweep(engine, ids[:constrained]) if sweep and constrained else None
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    shaped_ids, plain_ids = ids[:constrained], ids[constrained:]
    per_step = lambda group: sum(gained.get(i, 0) for i in group) / max(done * len(group), 1)
    return {
        "steps": done,
        "step_ms": round(1e3 * elapsed / max(done, 1), 3),
        "grammar_host_ms_per_step": round(1e3 * (spent["next_token_bitmask"] + spent["accept_many"] + spent["accept"]) / max(done, 1), 3),
        **{f"{name}_ms_per_step": round(1e3 * value / max(done, 1), 3) for name, value in spent.items()},
        "tokens_per_step_constrained_row": round(per_step(shaped_ids), 3) if shaped_ids else None,
        "tokens_per_step_plain_row": round(per_step(plain_ids), 3) if plain_ids else None,
        "constrained_output_tail": sample,
        **({"fill_sweep": swept} if swept else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny model on the CPU (checks the script)")
    parser.add_argument("--commit", default="?", help="recorded in the output")
    parser.add_argument("--profile-host", action="store_true", help="cProfile the constrained run's timed steps")
    parser.add_argument("--fill-sweep", action="store_true",
                        help="after the constrained run, time its rows' mask fill on 1, 2, 4, 8 threads")
    args = parser.parse_args()
    engine, prompt_len = build_engine(args)
    print(json.dumps({"bench": "structured_overhead", "date": datetime.date.today().isoformat(),
                      "device": torch.cuda.get_device_name() if not args.tiny else "cpu", "commit": args.commit,
                      "cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
                      "batch": args.batch, "constrained_rows": args.batch // 2,
                      "workload": "embedded-tiny" if args.tiny else f"v4flash-{args.layers}x{args.experts}"}),
          flush=True)
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(2, min(engine.runner.config.vocab_size, 100000), (args.batch, prompt_len),
                            generator=gen).tolist()
    steady_steps(engine, prompts, args.batch // 2, 2)  # warm-up: compiles the grammar, grows the allocator
    rows = {}
    for name, constrained in (("plain", 0), ("half_constrained", args.batch // 2)):
        rows[name] = steady_steps(engine, prompts, constrained, args.steps, args.profile_host and constrained > 0,
                                  args.fill_sweep)
        print(json.dumps({"run": name, **rows[name]}), flush=True)
    overhead = rows["half_constrained"]["step_ms"] / rows["plain"]["step_ms"] - 1
    print(json.dumps({"step_overhead": round(overhead, 4), "target": "< 0.05",
                      "grammar_host_share": round(rows["half_constrained"]["grammar_host_ms_per_step"]
                                                  / rows["half_constrained"]["step_ms"], 4)}), flush=True)


if __name__ == "__main__":
    main()
