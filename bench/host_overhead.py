"""Host overhead of the engine's decode step: wall time per step minus the time in the model and sampler.

    python bench/host_overhead.py [--batch 1,16,64,256] [--steps 32] [--mode eager,graph] [--device cpu]
                                  [--stop] [--logprobs N] [--spec K] [--async-scheduling] [--profile] [--top 25]

A model so small its forward is cheap (hidden 64, the three attention kinds, vocabulary 1024, fp32)
with the real DeepSeek-V4 tokenizer (the recipe plugin's fallback: the checkpoint ships no tokenizer.json,
as 129,280 ids do not fit a 1,024-id model). `batch` requests of 16-token prompts decode together
(temperature 0.8, top-p 0.95, seeded, EOS ignored, detokenized as the engine always does; `--stop` adds a
stop string that never matches, `--logprobs N` asks for N top logprobs). After the prefill step and two warm-up
decode steps, `--steps` decode steps of `Engine.step()` are timed.

Per step: `wall` (the whole `Engine.step()`), `forward` (the model: its `__call__` and `rope_tables`,
or a CUDA graph's replay), `sample` (the sampler), and `host` = wall - forward - sample: the work a
faster model cannot shrink (scheduling, input building, output processing, detokenization). On the CPU
(one thread) forward and sample are host timers; on a GPU (`--device cuda`) they are the device time
between CUDA events around the calls, so `host` is the time the GPU spends waiting for the host.
`gap` is the host time from the first read of a step's results (its sampled tokens) to the next step's
forward call: the time a device waits between two steps for a host that cannot run ahead (on the CPU,
where every call is synchronous, the only measure of it). Work the engine does after launching the
next step (a verification step's outputs under `async_scheduling`) is not in it. `--async-scheduling`
turns the engine's overlapped scheduling on, as on a GPU.
Modes: `eager` builds flat inputs (`ModelRunner.prepare_inputs`); `graph` runs decode through
`DecodeGraphs`: captured CUDA graphs on a GPU, and on the CPU the same static-buffer inputs run eagerly.

`--spec K` makes every step a verify step of K drafts per request (the fixed policy; drafts that
repeat the last token, which seeded sampling mostly rejects): the host work of speculative decoding.
`--profile` prints a cProfile top list of the host part only (the profiler is off inside the model
and the sampler); `--profile-gap` one of the gaps only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.models.layer_plan import BLOCK_SIZE
from deepinfer_core.testing.checkpoints import tiny_config, write_checkpoint
from deepinfer_core.worker.graphs import DecodeGraphs

PROMPT_LEN = 16
VOCAB = 1024


class _Clock:
    """Adds up the time spent in wrapped calls and pauses the profiler inside them. On a GPU it times
    the calls' device work with events (host timers would only see the launches)."""

    def __init__(self, device: torch.device, profiler: cProfile.Profile | None,
                 gap_profiler: cProfile.Profile | None = None) -> None:
        self.is_cuda, self.profiler, self.seconds = device.type == "cuda", profiler, 0.0
        self.gap_profiler = gap_profiler
        """Profiles only the gaps (`--profile-gap`): enabled at a read, disabled at the next forward."""
        self.is_profiling = False
        """Set while the timed steps run under the profiler."""
        self._events: list = []
        self.read_at, self.gap_seconds = None, 0.0
        """When the host last began reading a step's results (`_mark_reads`), and the host time from each
        such read to the next call timed here (the forward's clock: the next step's launch)."""

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self.is_profiling and self.profiler is not None:
                self.profiler.disable()
            if self.read_at is not None:
                self.gap_seconds += time.perf_counter() - self.read_at
                self.read_at = None
                if self.gap_profiler is not None:
                    self.gap_profiler.disable()
            if self.is_cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.is_cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    self._events.append((start, end))
                else:
                    self.seconds += time.perf_counter() - start
                if self.is_profiling and self.profiler is not None:
                    self.profiler.enable()
        return timed

    def collect(self) -> None:
        """Add the device times of the calls so far (call after a synchronize)."""
        self.seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1e3
        self._events.clear()


class _Timed:
    """Stands in for the runner's model, a captured graph or the sampler; `clock` times `methods`."""

    def __init__(self, target, clock: _Clock, methods: tuple[str, ...]) -> None:
        self._target, self._call = target, clock.wrap(target) if callable(target) else None
        for name in methods:
            setattr(self, name, clock.wrap(getattr(target, name)))

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._target, name)


def write_model(directory: Path) -> None:
    write_checkpoint(directory, tiny_config(vocab_size=VOCAB, max_position_embeddings=4096), seed=0)


class RepeatDrafter:
    """Proposes the request's last token again (`--spec`): every step verifies its drafts, which
    seeded sampling mostly rejects, so each step pays a verify step's host work."""

    has_confidences = False

    def propose(self, seq, max_drafts: int):
        return [seq.token_ids[-1]] * max_drafts, None


def build_engine(model_dir: Path, batch: int, steps: int, mode: str, device: str, spec: int = 0,
                 async_scheduling: bool | None = None) -> Engine:
    max_len = PROMPT_LEN + (spec + 1) * steps + 8
    blocks_per_seq = -(-max_len // BLOCK_SIZE)
    engine = Engine(EngineConfig(
        model=str(model_dir), dtype="float32", device=device, max_num_seqs=batch,
        max_num_batched_tokens=max(batch * PROMPT_LEN, 2048), max_model_len=max_len,
        num_kv_blocks=batch * blocks_per_seq, enforce_eager=mode == "eager",
        speculative_config={"method": "ngram", "num_speculative_tokens": spec, "draft_length_policy": "fixed"}
        if spec else None, async_scheduling=async_scheduling,
    ))
    if spec:
        engine.speculator.drafter = RepeatDrafter()
    if mode == "graph" and device == "cpu":  # the graphs' input path, run eagerly (verify steps: width k + 1)
        engine.runner.graphs = DecodeGraphs(engine.runner.model, engine.runner.kv_cache, engine.runner.inputs,
                                            batch, blocks_per_seq, max_len, widths=(1, spec + 1))
    if mode == "graph" and engine.runner.graphs is None:
        raise RuntimeError("no decode graphs on this device (a backend does not support them)")
    return engine


def _install_clocks(engine: Engine, profiler: cProfile.Profile | None,
                    gap_profiler: cProfile.Profile | None = None) -> tuple[_Clock, _Clock]:
    runner = engine.runner
    forward, sample = _Clock(runner.device, profiler, gap_profiler), _Clock(runner.device, profiler)
    # the input batch (`rope_tables`) and the decode graphs (their eager passes) hold the model too
    runner.model = runner.inputs.model = _Timed(runner.model, forward, ("rope_tables",))
    if runner.graphs is not None:
        runner.graphs.model = runner.model
        captured = runner.graphs.graphs
        for key, (graph, *outputs) in captured.items():  # (graph, logits, final streams)
            captured[key] = (_Timed(graph, forward, ("replay",)), *outputs)
    runner.sampler = _Timed(runner.sampler, sample, ("sample",))
    runner.sample_late = _mark_reads(runner.sample_late, forward)  # `sample` and the executor's call it
    return forward, sample


def _mark_reads(sample_late, clock: _Clock):
    """`ModelRunner.sample_late` whose completions note when they start (the host's first read of the
    step's results) in `clock.read_at`."""
    def marked(grammar_bitmask=None):
        complete = sample_late(grammar_bitmask)

        def read():
            clock.read_at = time.perf_counter()
            if clock.gap_profiler is not None and clock.is_profiling:
                clock.gap_profiler.enable()
            return complete()
        return read
    return marked


def measure(model_dir: Path, batch: int, args: argparse.Namespace, mode: str) -> dict:
    engine = build_engine(model_dir, batch, args.steps, mode, args.device, args.spec,
                          True if args.async_scheduling else None)
    profiler = cProfile.Profile() if args.profile or args.profile_gap else None
    if args.profile_gap:  # only from each read of a step's tokens to the next forward
        forward, sample = _install_clocks(engine, None, profiler)
    else:
        forward, sample = _install_clocks(engine, profiler)
    generator = torch.Generator().manual_seed(batch)
    stop = ["\x00never\x00"] if args.stop else []
    for i in range(batch):
        prompt = torch.randint(2, VOCAB, (PROMPT_LEN,), generator=generator).tolist()
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=(args.spec + 1) * (args.steps + 3),
                                ignore_eos=True,
                                stop=stop, logprobs=args.logprobs)
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(3):  # the prefill, then two decode steps
        engine.step()
    synchronize = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    synchronize()
    forward.collect()
    sample.collect()
    forward.seconds = sample.seconds = forward.gap_seconds = 0.0
    forward.is_profiling = sample.is_profiling = profiler is not None
    wall = 0.0
    for _ in range(args.steps):
        if profiler is not None and not args.profile_gap:
            profiler.enable()
        start = time.perf_counter()
        outputs = engine.step()  # ends with a device read of the sampled tokens
        wall += time.perf_counter() - start
        if profiler is not None and not args.profile_gap:
            profiler.disable()
        if len(outputs) != batch:
            raise RuntimeError(f"expected {batch} outputs a step, got {len(outputs)}")
    synchronize()
    forward.collect()
    sample.collect()
    per_step = 1e3 / args.steps
    result = {
        "batch": batch, "mode": mode, "wall_ms": wall * per_step, "forward_ms": forward.seconds * per_step,
        "sample_ms": sample.seconds * per_step,
    }
    result["host_ms"] = result["wall_ms"] - result["forward_ms"] - result["sample_ms"]
    result["host_us_per_request"] = result["host_ms"] * 1e3 / batch
    result["gap_ms"] = forward.gap_seconds * per_step
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        result["profile"] = text.getvalue()
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--batch", default="1,16,64,256", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    parser.add_argument("--mode", default="eager,graph", help="eager, graph or both (comma-separated)")
    parser.add_argument("--stop", action="store_true", help="give every request a (never matching) stop string")
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs per request")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--profile", action="store_true", help="print a cProfile top list of the host part")
    parser.add_argument("--profile-gap", action="store_true",
                        help="print a cProfile top list of the gaps only (each step's token read to the next forward)")
    parser.add_argument("--spec", type=int, default=0, metavar="K",
                        help="speculative decoding: every step verifies K drafts (the last token repeated)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="the engine's async_scheduling on (a GPU's default; on the CPU the steps run the same "
                             "code, synchronously)")
    parser.add_argument("--top", type=int, default=25, help="rows of the profile")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)  # keeps the engine's INFO lines (cache size) out of the table
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp))
        for mode in args.mode.split(","):
            for batch in (int(b) for b in args.batch.split(",")):
                result = measure(Path(tmp), batch, args, mode)
                profile = result.pop("profile", None)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
                if profile:
                    print(profile)
                rows.append(result)
    print("\n| mode | batch | wall ms/step | forward ms | sample ms | host ms | host us/request | gap ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['batch']} | {r['wall_ms']:.2f} | {r['forward_ms']:.2f} | {r['sample_ms']:.2f} "
              f"| {r['host_ms']:.2f} | {r['host_us_per_request']:.1f} | {r['gap_ms']:.2f} |")


if __name__ == "__main__":
    main()
