"""The CPU workload (shared/BENCH.md): DeepInfer's `LLM.generate` against transformers' `generate`.

    python bench/cpu_throughput.py [--batch 16[,64]] [--mixed] [--dtype bfloat16] [--threads 2] [--quick]

One tiny DeepSeek-V4 model: hidden 128, 3 layers (sliding window / CSA / HCA) with V4's real attention
shapes where they matter on a CPU (head_dim 512, RoPE dims 64, window 128, CSA rate 4, HCA rate 128,
hc_mult 4), 8 heads, 64 routed experts of width 64, top-6, one shared expert, the first layer hash-routed,
the real vocabulary (129280; `--vocab` to change). Random weights (normal, std 0.02), the same tensors on
both sides: written as a checkpoint for DeepInfer, `load_state_dict` into transformers 5.23's
`DeepseekV4ForCausalLM`.

Per batch size: `batch` random prompts of 256 tokens (`--mixed`: 64-512, left-padded for transformers),
64 new tokens, greedy, EOS ignored (transformers: `do_sample=False`, `min_new_tokens = max_new_tokens`).
Both sides are warmed up once, then timed end to end (prefill included); the time is the median of
`--repeats` runs. Printed: one JSON line per configuration (wall times, generated tokens/s, the ratio,
greedy agreement, DeepInfer's per-step time split), then a table. `--profile` adds a cProfile top-20 of
DeepInfer's side.

Greedy agreement compares each prompt's generated tokens up to the first difference; with random
weights near-ties are common, so a divergence after some tokens (bf16 especially) is expected. Under
`--mixed`, only the prompts of the longest length (no padding) are compared: transformers' compressed
attention does not account for left padding the way separate requests do.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import platform
import pstats
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import ModelConfig
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config, write_checkpoint

WORKLOAD = {
    "hidden_size": 128, "moe_intermediate_size": 64, "num_attention_heads": 8, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "index_n_heads": 4, "index_head_dim": 128, "index_topk": 32,
    "sliding_window": 128, "hc_mult": 4,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
}  # fmt: skip
PAD_ID = 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--batch", default="16", help="comma-separated batch sizes (default 16; e.g. 16,64)")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt length (default 256)")
    parser.add_argument("--mixed", action="store_true", help="prompt lengths uniform in [64, 512] instead")
    parser.add_argument("--new-tokens", type=int, default=64, help="generated tokens per prompt (default 64)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 under --quick). On a machine shared with busy "
                             "processes more threads spin in OpenMP barriers: use 1 or OMP_WAIT_POLICY=PASSIVE")
    parser.add_argument("--vocab", type=int, default=129280, help="vocabulary size (default: V4's 129280)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per side; the median is reported")
    parser.add_argument("--hf-experts", default=None,
                        help="transformers' experts_implementation (default: its own default, eager)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile top-20 of DeepInfer's side")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: batch 4, 64-token prompts, 8 new tokens, vocab 32000, 1 thread")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.prompt_len, args.new_tokens, args.vocab, args.mixed = "4", 64, 8, 32000, False
        args.threads = args.threads or 1
    args.batches = [int(b) for b in args.batch.split(",")]
    if min(args.batches) < 1 or args.new_tokens < 1 or args.prompt_len < 1 or args.repeats < 1:
        parser.error("--batch, --prompt-len, --new-tokens and --repeats must be positive")
    return args


def _computes_several_tokens(schedule) -> bool:
    """Whether a scheduled step computes more than one token of some request (a prefill): from a step
    plan's requests, or from a batch's `num_new_tokens`."""
    counts = getattr(schedule, "num_new_tokens", None)
    if counts is None:
        counts = [len(r.token_ids) for r in getattr(schedule, "requests", ())]
    return max(counts, default=0) > 1


# -- the model, both sides --------------------------------------------------------------------------


def workload_config(vocab_size: int) -> dict:
    return tiny_config("sliding_csa_hca", vocab_size=vocab_size, max_position_embeddings=4096, **WORKLOAD)


def build_transformers(config: dict, state_dict: dict, dtype: torch.dtype, experts: str | None):
    import transformers

    transformers.logging.set_verbosity_error()  # its YaRN-factor notice about the tiny config
    hf_config = transformers.DeepseekV4Config(**ModelConfig.from_dict(config).to_hf_dict())
    options = {"experts_implementation": experts} if experts else {}
    model = transformers.DeepseekV4ForCausalLM._from_config(hf_config, dtype=dtype, **options)
    model.load_state_dict(state_dict, strict=True)  # copies, casting to each parameter's dtype
    return model.eval()


def build_engine(directory: Path, args: argparse.Namespace, max_prompt: int) -> LLM:
    return LLM(model=str(directory), dtype=args.dtype, max_model_len=max_prompt + args.new_tokens + 8,
               max_num_seqs=max(args.batches), device="cpu")


def make_prompts(batch: int, args: argparse.Namespace, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234 + batch)
    if args.mixed:
        lengths = torch.randint(64, 513, (batch,), generator=generator).tolist()
    else:
        lengths = [args.prompt_len] * batch
    return [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in lengths]


def run_transformers(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=PAD_ID)
    return out[:, width:].tolist()


def run_engine(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def timed(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


# -- the engine's per-step split --------------------------------------------------------------------


class StepSplit:
    """Wraps the engine's step phases with timers; sums them per step kind (prefill / decode).

    A step is "prefill" when any sequence in it computes more than one token."""

    PHASES = ("schedule", "prepare", "forward", "sample")

    def __init__(self, llm: LLM) -> None:
        engine, runner = llm.engine, llm.engine.runner
        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._current: dict[str, float] = {}
        self._kind = "idle"
        self._wrap(engine.scheduler, "schedule", "schedule", tag=True)
        self._wrap(runner, "prepare_inputs", "prepare")
        self._wrap(runner.model, "forward", "forward")
        self._wrap(runner.sampler, "sample", "sample")
        step = engine.step

        def timed_step():
            self._current, self._kind = defaultdict(float), "idle"
            start = time.perf_counter()
            out = step()
            bucket = self.totals[self._kind]
            bucket["steps"] += 1
            bucket["total"] += time.perf_counter() - start
            for phase, seconds in self._current.items():
                bucket[phase] += seconds
            return out

        engine.step = timed_step

    def _wrap(self, owner, attr: str, phase: str, tag: bool = False) -> None:
        """Time `owner.attr` as `phase`; `tag`: its result (the step's schedule) says prefill or decode."""
        inner = getattr(owner, attr, None)
        if inner is None:  # the runner no longer has this phase as a method: it is reported as 0
            return

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                result = inner(*args, **kwargs)
                if tag and result is not None:
                    self._kind = "prefill" if _computes_several_tokens(result) else "decode"
                return result
            finally:
                self._current[phase] += time.perf_counter() - start

        setattr(owner, attr, wrapper)

    def reset(self) -> None:
        self.totals.clear()

    def summary(self) -> dict:
        out = {}
        for kind, bucket in self.totals.items():
            if kind == "idle":
                continue
            steps = int(bucket["steps"])
            other = bucket["total"] - sum(bucket[p] for p in self.PHASES)
            out[kind] = {"steps": steps, "total_s": round(bucket["total"], 4),
                         "ms_per_step": {p: round(1e3 * bucket[p] / steps, 3) for p in self.PHASES}
                         | {"other": round(1e3 * other / steps, 3)}}
        return out


# -- agreement, reporting ---------------------------------------------------------------------------


def agreement(ours: list[list[int]], theirs: list[list[int]], rows: list[int]) -> dict:
    prefixes = []
    for row in rows:
        a, b = ours[row], theirs[row]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    if not prefixes:
        return {"rows_compared": 0}
    length = len(ours[rows[0]])
    return {
        "rows_compared": len(rows),
        "first_token_equal": round(sum(p > 0 for p in prefixes) / len(prefixes), 3),
        "first8_equal": round(sum(p >= min(8, length) for p in prefixes) / len(prefixes), 3),
        "all_equal": round(sum(p == length for p in prefixes) / len(prefixes), 3),
        "mean_common_prefix": round(sum(prefixes) / len(prefixes), 2),
    }


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def print_table(rows: list[dict]) -> None:
    print(f"\n{'dtype':9s} {'batch':>5s} {'prompts':>8s} {'deepinfer s':>12s} {'tok/s':>8s} "
          f"{'transformers s':>15s} {'tok/s':>8s} {'ratio':>6s} {'greedy 1st/prefix':>18s}")
    for r in rows:
        g = r["greedy"]
        agree = f"{g.get('first_token_equal', float('nan')):.2f}/{g.get('mean_common_prefix', float('nan')):.1f}"
        print(f"{r['dtype']:9s} {r['batch']:5d} {r['prompt_lens']:>8s} {r['deepinfer_s']:12.3f} "
              f"{r['deepinfer_tok_s']:8.1f} {r['transformers_s']:15.3f} {r['transformers_tok_s']:8.1f} "
              f"{r['speedup']:6.2f} {agree:>18s}")


def profile_engine(llm: LLM, prompts: list[list[int]], new_tokens: int) -> None:
    profiler = cProfile.Profile()
    profiler.runcall(run_engine, llm, prompts, new_tokens)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    print(f"\ncProfile of DeepInfer, batch {len(prompts)}, top 20 by own time:\n{text.getvalue()}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = workload_config(args.vocab)
    state_dict = random_state_dict(config)
    workdir = Path(tempfile.mkdtemp(prefix="deepinfer-cpu-bench-"))
    write_checkpoint(workdir, config, state_dict=state_dict)
    prompt_sets = {b: make_prompts(b, args, args.vocab) for b in args.batches}
    max_prompt = max(len(p) for ps in prompt_sets.values() for p in ps)
    llm = build_engine(workdir, args, max_prompt)
    hf_model = build_transformers(config, state_dict, dtype, args.hf_experts)
    header = {"bench": "cpu_throughput", "date": datetime.date.today().isoformat(), "commit": git_commit(),
              "machine": f"{platform.machine()} {torch.get_num_threads()} threads", "torch": torch.__version__,
              "dtype": args.dtype, "vocab": args.vocab, "new_tokens": args.new_tokens,
              "hf_experts": args.hf_experts or "default"}
    print(json.dumps(header), flush=True)

    warm = prompt_sets[args.batches[0]][:2]  # once per side: allocator, kernels, first-call paths
    run_engine(llm, warm, 4)
    run_transformers(hf_model, warm, 4)
    split = StepSplit(llm)
    rows = []
    for batch in args.batches:
        prompts = prompt_sets[batch]
        split.reset()
        ours_s, ours = timed(lambda p=prompts: run_engine(llm, p, args.new_tokens), args.repeats)
        steps = split.summary()
        theirs_s, theirs = timed(lambda p=prompts: run_transformers(hf_model, p, args.new_tokens), args.repeats)
        longest = max(len(p) for p in prompts)
        comparable = [i for i, p in enumerate(prompts) if len(p) == longest]
        generated = batch * args.new_tokens
        row = {
            "dtype": args.dtype, "batch": batch,
            "prompt_lens": "64-512" if args.mixed else str(args.prompt_len),
            "prompt_tokens": sum(len(p) for p in prompts), "new_tokens": args.new_tokens,
            "deepinfer_s": round(ours_s, 4), "transformers_s": round(theirs_s, 4),
            "deepinfer_tok_s": round(generated / ours_s, 1), "transformers_tok_s": round(generated / theirs_s, 1),
            "speedup": round(theirs_s / ours_s, 3), "greedy": agreement(ours, theirs, comparable),
            "deepinfer_steps": steps,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    print_table(rows)
    if args.profile:
        profile_engine(llm, prompt_sets[args.batches[0]], args.new_tokens)


if __name__ == "__main__":
    main()
