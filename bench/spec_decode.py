"""Speculative decoding's machinery on the "v4flash-LxE" workload (bench/gpu_decode.py builds it).

    python bench/spec_decode.py [--layers 2] [--experts 256] [--batches 1,16,64] [--ks 1,2,3,4,5]
        [--new-tokens 33] [--eager] [--tiny] [--profile 1,16] [--verify-cost 0.02] [--sync-cost 0.25]

Random weights make real acceptance meaningless, so three drafters measure the machinery honestly:
(a) an oracle that replays the target's own greedy continuation (every draft accepted): decode tokens/s
per request against no speculation for each k, printed beside the speed-up the memory floor allows,
`(k + 1) x bytes(1-token step) / bytes((k + 1)-token step)`, counting the distinct routed experts the
extra tokens touch; (b) an always-wrong drafter at k = 3 with the fixed and the confidence policy (its
overhead against no speculation); (c) the n-gram drafter on a repetitive agent-like trace (prompts
that quote a tool output back, greedy outputs that loop) with the fixed and the confidence policy:
acceptance length, speed-up, and how many steps stayed overlapped (left in flight) and were probes;
(d) with `--mtp`, the MTP drafter at k = 3 on an "echo" model, whose MTP layer predicts what the target
will emit (every attention and MoE output zero, as in tests/engine/test_spec_mtp.py; the MTP layer reuses
the last layer's tensors, so it costs a real layer's time): speed-up against no speculation on the same
weights, acceptance length, and the allowed speed-up beside it, so the MTP layer's drafting time shows
against the oracle's.
Every run also checks that its tokens equal those of no speculation; where they do not, it reports the
first divergence (request, step) and the reference's logprob gap there between its token and the
speculative run's (bf16: a (k + 1)-token verify step is not bitwise the 1-token decode computation, so
near-ties may flip; a large gap is a bug). Decode steps and verify steps whose requests all carry the
same number of drafts replay CUDA graphs unless `--eager`. `--deterministic` runs both engines in
deterministic mode, where a verify step computes bitwise what decode steps would, so the oracle's
acceptance stays 1. `--tiny` runs a small config on the CPU
(checks the script; overlapped decode is on there too, so the n-gram case's step counts are those of
the GPU). One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu_decode as workload


class ReplayDrafter:
    """Proposes the continuation recorded for the prompt (`shift` 0: the target's own greedy tokens,
    always accepted; 1: a token that is never the target's, always rejected)."""

    has_confidences = False  # the requests' acceptance histories estimate its drafts' survival

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], shift: int, vocab: int) -> None:
        self.continuations, self.shift, self.vocab = continuations, shift, vocab

    def propose(self, seq, max_drafts):
        future = self.continuations[tuple(seq.prompt_token_ids)][seq.num_output_tokens :][:max_drafts]
        return [(t + self.shift) % self.vocab for t in future], None


def step_bytes(counts: workload.Counts, num_tokens: int, num_requests: int, context: int) -> float:
    """Bytes a step of `num_tokens` tokens over `num_requests` requests reads at the memory floor:
    dense weights once, each distinct routed expert once, each request's cache once."""
    kv = 0
    for rate in counts.layer_rates:
        entries = context // rate if rate else 0
        read = 128 + (min(entries, counts.index_topk) if rate == 4 else entries)
        kv += read * counts.head_dim + (entries * counts.index_head_dim if rate == 4 else 0)
    return (counts.dense_bytes + counts.num_layers * workload.expected_touched(counts, num_tokens) * counts.expert_bytes
            + num_requests * kv * counts.element_size)


def allowed_speedup(counts: workload.Counts, batch: int, k: int, context: int) -> float:
    """(k + 1) x bytes(1-token step) / bytes((k + 1)-token step), at `batch` requests."""
    one = step_bytes(counts, batch, batch, context)
    return (k + 1) * one / step_bytes(counts, batch * (k + 1), batch, context)


def generate(engine, prompts: list[list[int]], new_tokens: int, repeats: int = 1) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt, and the decode time: from the moment every request has its first
    token to the last token (`RequestMetrics` timestamps), so prefill does not count. With `repeats`,
    the median time of that many runs (the tokens of the last; every run's are checked equal)."""
    times, tokens = [], None
    for _ in range(repeats):
        outs = workload.engine_outputs(engine, prompts, new_tokens)
        workload.sync()
        start = max(o.metrics.first_token_time for o in outs)
        end = max(o.metrics.last_token_time for o in outs)
        times.append(max(end - start, 1e-9))
        run = [list(o.outputs[0].token_ids) for o in outs]
        assert tokens is None or run == tokens, "a repeated run gave other tokens"
        tokens = run
    return tokens, statistics.median(times)


def compare(plain, prompts: list[list[int]], reference: list[list[int]], out: list[list[int]]) -> dict:
    """`tokens_equal`, and when false the first divergence: its request and step, and the reference
    logprob gap there (reference token minus the speculative run's token, from a rerun of the plain
    engine over the same batch with logprobs; None when that token is not in its top 20)."""
    if out == reference:
        return {"tokens_equal": True}
    from deepinfer_core.sampling_params import SamplingParams

    request, step = min((s, r) for r, (a, b) in enumerate(zip(reference, out))
                        for s, (x, y) in enumerate(zip(a, b)) if x != y)[::-1]
    if plain is None:  # the plain engine is gone (freed for the speculative one's memory)
        return {"tokens_equal": False, "first_divergence": {"request": request, "step": step}}
    params = SamplingParams(max_tokens=len(reference[0]), temperature=0, ignore_eos=True, logprobs=20)
    for i, prompt in enumerate(prompts):
        plain.add_request(f"lp{i}", prompt, params)
    done = {}
    while plain.has_unfinished_requests():
        done.update({o.request_id: o for o in plain.step() if o.finished})
    rerun = done[f"lp{request}"].outputs[0]
    entry = rerun.logprobs[step]
    ours, theirs = reference[request][step], out[request][step]
    gap = entry[ours].logprob - entry[theirs].logprob if ours in entry and theirs in entry else None
    return {"tokens_equal": False, "first_divergence": {
        "request": request, "step": step, "reference_logprob_gap": None if gap is None else round(gap, 5),
        "rerun_equals_reference": list(rerun.token_ids) == reference[request]}}


def set_spec(engine, k: int, policy: str, drafter, verify_cost: float = 0.02, sync_cost: float = 0.25) -> None:
    speculator = engine.speculator
    speculator.config = speculator.config.model_copy(update={
        "num_speculative_tokens": k, "draft_length_policy": policy, "verify_cost_per_token": verify_cost,
        "sync_cost": sync_cost})
    speculator.drafter = drafter


SPEC_COUNTERS = ("verify_steps", "verified_tokens", "accepted_tokens", "overlapped_steps", "probe_steps")


def spec_counts(before: dict, after: dict, runs: int) -> dict:
    """The engine's speculative counters a run, averaged over `runs` runs (`stats()` taken before and after)."""
    return {key: (after[f"spec_{key}"] - before[f"spec_{key}"]) // runs for key in SPEC_COUNTERS}


def report(row: dict) -> None:
    print(json.dumps(row), flush=True)


def run_batch(args, counts, plain, spec, prompts, vocab) -> None:
    batch, new = len(prompts), args.new_tokens
    context = workload.PROMPT_LEN + new // 2
    if args.warmup:
        generate(plain, prompts, new)
    reference, base_s = generate(plain, prompts, new, args.repeats)
    base = batch * (new - 1) / base_s  # tokens after the first, over the time they took
    report({"case": "none", "batch": batch, "decode_tok_s": round(base, 1),
            "per_request_tok_s": round(base / batch, 2)})
    continuations = {tuple(p): r for p, r in zip(prompts, reference)}
    for k in args.ks:
        set_spec(spec, k, "fixed", ReplayDrafter(continuations, 0, vocab))
        if args.warmup:  # at this k: kernels compile, the allocator grows
            generate(spec, prompts, new)
        out, seconds = generate(spec, prompts, new, args.repeats)
        speed = batch * (new - 1) / seconds
        report({"case": "oracle", "batch": batch, "k": k, "decode_tok_s": round(speed, 1),
                "per_request_tok_s": round(speed / batch, 2), "speedup": round(speed / base, 3),
                "allowed_speedup": round(allowed_speedup(counts, batch, k, context), 3),
                "of_allowed": round(speed / base / allowed_speedup(counts, batch, k, context), 3),
                **compare(plain, prompts, reference, out)})
    if batch in args.profile:  # where a step's time goes: device time by kernel, and the step's wall time
        workload.profile_decode(plain, prompts, "none")
        set_spec(spec, 3, "fixed", ReplayDrafter(continuations, 0, vocab))
        workload.profile_decode(spec, prompts, "oracle_k3", tokens_per_step=4)
    for policy in ("fixed", "confidence"):
        set_spec(spec, 3, policy, ReplayDrafter(continuations, 1, vocab), args.verify_cost, args.sync_cost)
        if args.warmup:
            generate(spec, prompts, new)
        before = spec.stats()
        out, seconds = generate(spec, prompts, new, args.repeats)
        counts = spec_counts(before, spec.stats(), args.repeats)
        speed = batch * (new - 1) / seconds
        report({"case": "always_wrong", "policy": policy, "verify_cost_per_token": args.verify_cost,
                "sync_cost": args.sync_cost,
                "batch": batch, "k": 3, "decode_tok_s": round(speed, 1),
                "slowdown": round(1 - speed / base, 3), "request_verify_steps": counts["verify_steps"],
                "verified_tokens": counts["verified_tokens"], "overlapped_steps": counts["overlapped_steps"],
                "probe_steps": counts["probe_steps"], **compare(plain, prompts, reference, out)})


def agent_trace(batch: int, vocab: int, seed: int = 1) -> list[list[int]]:
    """Prompts shaped like agent turns: a system part, a tool output, then the same output quoted back."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(batch):
        system = torch.randint(2, vocab, (128,), generator=generator).tolist()
        tool = torch.randint(2, vocab, (160,), generator=generator).tolist()
        prompts.append((system + tool + system[:64] + tool)[: workload.PROMPT_LEN])
    return prompts


def run_ngram(args, plain, spec, vocab) -> None:
    """The n-gram drafter on the agent trace, with the fixed policy (every step waits for its tokens to
    look drafts up) and the confidence policy (a request drafts only while its estimates say it pays, so
    other steps stay overlapped; probes look again now and then)."""
    from deepinfer_core.speculative.proposer import NgramDrafter

    for batch in args.batches:
        prompts = agent_trace(batch, vocab)
        if args.warmup:
            generate(plain, prompts, args.new_tokens)
        reference, base_s = generate(plain, prompts, args.new_tokens, args.repeats)
        for policy in ("fixed", "confidence"):
            set_spec(spec, 3, policy, NgramDrafter(1, 4), args.verify_cost, args.sync_cost)
            if args.warmup:
                generate(spec, prompts, args.new_tokens)
            before = spec.stats()
            out, seconds = generate(spec, prompts, args.new_tokens, args.repeats)
            delta = spec_counts(before, spec.stats(), args.repeats)
            steps = delta["verify_steps"]
            report({"case": "ngram_agent_trace", "policy": policy, "batch": batch, "k": 3,
                    "speedup": round(base_s / seconds, 3),
                    "mean_acceptance_length": round((delta["accepted_tokens"] + steps) / steps, 3) if steps else None,
                    "request_verify_steps": steps, "overlapped_steps": delta["overlapped_steps"],
                    "probe_steps": delta["probe_steps"], "decode_steps_without_spec": args.new_tokens - 1,
                    **compare(plain, prompts, reference, out)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--ks", default="1,2,3,4,5")
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per measurement, the median reported (1 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="small config on the CPU (checks the script)")
    parser.add_argument("--verify-cost", type=float, default=0.02,
                        help="the confidence policy's verify_cost_per_token (a verified token's cost relative "
                        "to a step's fixed cost)")
    parser.add_argument("--profile", default="", metavar="BATCHES",
                        help="profile a plain decode step and an oracle k = 3 verify step at these batch sizes "
                        "(device time by kernel against the step's wall time)")
    parser.add_argument("--sync-cost", type=float, default=0.25,
                        help="the confidence policy's sync_cost (a verify step's host round trip, which a plain "
                        "decode step overlaps, relative to a step's fixed cost)")
    parser.add_argument("--eager", action="store_true",
                        help="no CUDA graphs on either side (verify steps always run eagerly; this compares like "
                        "with like)")
    parser.add_argument("--mtp", action="store_true",
                        help="also the MTP drafter at k = 3 on the echo model (two more engines)")
    parser.add_argument("--mtp-only", action="store_true", help="only the MTP drafter's case (implies --mtp)")
    parser.add_argument("--deterministic", action="store_true",
                        help="both engines in deterministic mode: a verify step's logits are then bitwise the "
                        "decode step's, so the oracle's drafts stay the target's own tokens (bf16 near ties "
                        "cannot flip)")
    args = parser.parse_args(argv)
    args.warmup = not args.tiny  # a warm-up run before each timed one, except in the CPU smoke mode
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.tiny:
        args.repeats = 1
    args.batches = [int(b) for b in args.batches.split(",")]
    args.ks = [int(k) for k in args.ks.split(",")]
    args.profile = [int(b) for b in args.profile.split(",") if b]
    if args.tiny:
        args.experts = min(args.experts, 8)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = workload.build_config(args)
    model = workload.build_model(config, device, dtype)
    counts = workload.count(model, config)
    max_batch = max(args.batches)
    # the extra new tokens leave room for k drafts past the last one
    new = args.new_tokens + max(args.ks)
    if args.mtp_only:
        run_mtp(args, config, model, counts, device, dtype, max_batch, new)
        return
    plain = workload.build_engine(config, model, device, dtype, max_batch, new, enforce_eager=args.eager,
                                  async_scheduling=True, graph_sizes=args.batches, deterministic=args.deterministic)
    spec = build_spec_engine(config, model, device, dtype, max_batch, new, max(args.ks), args.eager, args.batches,
                             args.deterministic)
    vocab = config.vocab_size
    generator = torch.Generator().manual_seed(0)
    for batch in args.batches:
        prompts = torch.randint(2, vocab, (batch, workload.PROMPT_LEN), generator=generator).tolist()
        run_batch(args, counts, plain, spec, prompts, vocab)
    run_ngram(args, plain, spec, vocab)
    if args.mtp:
        del plain, spec
        run_mtp(args, config, model, counts, device, dtype, max_batch, new)


def echo_weights(config, model) -> dict[str, torch.Tensor]:
    """The model's tensors (shared, not copied) made into the echo model, plus an MTP layer `mtp.0.*`
    that predicts exactly what the target will emit: every attention and MoE output is zero (new zero
    `o_b_proj` and `down_proj` tensors), so a position's residual streams are copies of its token's
    embedding and the target's next token is a function of that token; the MTP layer reads the next
    token's embedding alone (`h_proj` zero, `e_proj` the identity) and ends in the target's final norm.
    Its attention and MoE are the last layer's tensors (its router a new non-hash one), so a draft costs
    a real layer's time."""
    weights = dict(model.state_dict())
    last = f"model.layers.{config.num_hidden_layers - 1}."
    for name, tensor in list(weights.items()):
        if name.endswith(("o_b_proj.weight", "experts.down_proj", "shared_experts.down_proj.weight")):
            weights[name] = torch.zeros_like(tensor)
    for name, tensor in list(weights.items()):
        if name.startswith(last) and ".compressor." not in name and ".gate." not in name:
            weights["mtp.0." + name[len(last):]] = tensor
    hidden, ref = config.hidden_size, weights["model.norm.weight"]
    generator = torch.Generator().manual_seed(1)
    gate = torch.randn(config.n_routed_experts, hidden, generator=generator) * 0.02
    weights |= {
        "mtp.0.mlp.gate.weight": gate.to(ref),
        "mtp.0.mlp.gate.e_score_correction_bias": torch.zeros(config.n_routed_experts, dtype=torch.float32,
                                                               device=ref.device),
        "mtp.0.enorm.weight": torch.ones_like(ref), "mtp.0.hnorm.weight": torch.ones_like(ref),
        "mtp.0.e_proj.weight": torch.eye(hidden, dtype=ref.dtype, device=ref.device),
        "mtp.0.h_proj.weight": torch.zeros(hidden, hidden, dtype=ref.dtype, device=ref.device),
        "mtp.0.norm.weight": ref.clone(),
        **{f"mtp.0.hc_head.{key}": weights[f"model.hc_head.{key}"] for key in ("hc_fn", "hc_base", "hc_scale")},
    }
    return weights


def run_mtp(args, config, model, counts, device, dtype, max_batch: int, new: int) -> None:
    """The MTP drafter (k = 3, every draft verified) on the echo model, against no speculation on the
    same weights: tokens equal, speed-up, acceptance length, and the speed-up the memory floor allows
    (the MTP layer's own reads not counted: what it costs shows as the gap to the oracle's figure)."""
    weights = echo_weights(config, model)
    options = {"enforce_eager": args.eager, "async_scheduling": True, "graph_sizes": args.batches,
               "deterministic": args.deterministic, "weights": weights}
    # one engine at a time (each holds its own copy of the echo model's weights): the plain runs first
    plain = workload.build_engine(config, model, device, dtype, max_batch, new, **options)
    generator = torch.Generator().manual_seed(2)
    runs = []
    for batch in args.batches:
        prompts = torch.randint(2, config.vocab_size, (batch, workload.PROMPT_LEN), generator=generator).tolist()
        if args.warmup:
            generate(plain, prompts, args.new_tokens)
        runs.append((batch, prompts, *generate(plain, prompts, args.new_tokens, args.repeats)))
    del plain
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    spec = workload.build_engine(config, model, device, dtype, max_batch, new, **options, speculative_config={
        "method": "mtp", "num_speculative_tokens": 3, "draft_length_policy": "fixed"})
    for batch, prompts, reference, base_s in runs:
        if args.warmup:
            generate(spec, prompts, args.new_tokens)
        before = spec.stats()
        out, seconds = generate(spec, prompts, args.new_tokens, args.repeats)
        delta = spec_counts(before, spec.stats(), args.repeats)
        steps = delta["verify_steps"]
        allowed = allowed_speedup(counts, batch, 3, workload.PROMPT_LEN + args.new_tokens // 2)
        report({"case": "mtp_echo", "batch": batch, "k": 3, "speedup": round(base_s / seconds, 3),
                "allowed_speedup": round(allowed, 3), "of_allowed": round(base_s / seconds / allowed, 3),
                "mean_acceptance_length": round((delta["accepted_tokens"] + steps) / steps, 3) if steps else None,
                "request_verify_steps": steps, **compare(None, prompts, reference, out)})


def build_spec_engine(config, model, device, dtype, max_batch, new_tokens, k, eager, graph_sizes=None,
                      deterministic=False):
    """`gpu_decode.build_engine`'s engine with speculation on (n-gram, k drafts at most), its decode
    graphs captured for `graph_sizes` (None: the engine's ladder)."""
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
    return workload.build_engine(config, model, device, dtype, max_batch, new_tokens, enforce_eager=eager,
                                 async_scheduling=True, speculative_config=spec, graph_sizes=graph_sizes,
                                 deterministic=deterministic)


if __name__ == "__main__":
    main()
