"""Expert-parallel scaling: per-rank throughput, the all-to-all's share of a step, and EPLB's balance.

    python bench/ep_scale.py [--ranks 2] [--device cpu] [--requests 16] [--prompt 96] [--new-tokens 24]
                             [--experts 16] [--top-k 2] [--hidden 64] [--skew 4] [--redundant 2]
                             [--step-interval 8] [--window 8] [--dtype float32]

Runs `--ranks` attention data-parallel ranks with the routed experts spread over all of them
(`data_parallel_size=N, enable_expert_parallel=True, enable_eplb=True`), on whatever the machine has:
CPU worker processes over gloo here, one GPU per rank over NCCL there (`--device cuda`; `--ranks 1`
runs the 1-GPU EP world: every collective runs, on a group of one). The model is a tiny DeepSeek-V4
(sliding / CSA / HCA layers, the first hash-routed) with random weights whose routing is skewed on
purpose: the top-k layers' score-correction bias favours the last eighth of the experts by `--skew`,
and the hash layer's token-to-expert table draws experts from a Zipf law (the last one most often);
the initial layout's redundant slots replicate the first experts, so they start out all on the last rank. Every `--step-interval`
steps EPLB places `experts + redundant` slots anew from the last `--window` steps of load and moves
the weights between the ranks.

Printed: one JSON line per rank (tokens it computed, tokens/s over the run, seconds in steps and in
the dispatch all-to-alls, the latter's share), then one line with the balance (busiest rank's routed
load / mean): before the first rebalance (the initial placement), what the first rebalance predicted,
and what the next window measured under the new placement; and the rebalance pause. The dispatch is
timed with the device synchronised around each collective (`time_ep_dispatch`), which slows a GPU run a
little; the share includes time a rank waits for slower ranks inside the collective.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.data_parallel import build_engine
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel = expert-parallel ranks (default 2)")
    parser.add_argument("--device", default="cpu", help='"cpu" (gloo processes) or "cuda" (one GPU a rank)')
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=96, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--experts", type=int, default=16, help="routed experts per layer")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--skew", type=float, default=4.0, help="score bias of the hot eighth of the experts")
    parser.add_argument("--redundant", type=int, default=2, help="num_redundant_experts (default 2)")
    parser.add_argument("--step-interval", type=int, default=8)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    return parser.parse_args(argv)


def skewed_model(args) -> tuple[dict, dict[str, torch.Tensor]]:
    config = tiny_config("sliding_csa_hca", hidden_size=args.hidden, n_routed_experts=args.experts,
                         num_experts_per_tok=args.top_k, index_n_heads=16)
    weights = random_state_dict(config, seed=0)
    hot = max(1, args.experts // 8)
    zipf = 1.0 / torch.arange(args.experts, 0, -1, dtype=torch.float64)  # the last expert most often
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        if name.endswith("e_score_correction_bias"):
            tensor.zero_()
            tensor[-hot:] = args.skew  # the last experts: the initial layout replicates the first ones
        elif name.endswith("tid2eid"):
            rows = [torch.multinomial(zipf, args.top_k, generator=generator) for _ in range(tensor.shape[0])]
            tensor.copy_(torch.stack(rows))
    return config, weights


def run(args) -> list[dict]:
    config, weights = skewed_model(args)
    directory = Path(tempfile.mkdtemp(prefix="ep_scale_"))
    (directory / "config.json").write_text(json.dumps(config))
    engine = build_engine(EngineConfig(
        model=str(directory), dtype=args.dtype, device=args.device, data_parallel_size=args.ranks,
        enable_expert_parallel=True, enable_eplb=True, time_ep_dispatch=True, max_num_seqs=max(args.requests, 1),
        num_kv_blocks=args.requests * -(-(args.prompt + args.new_tokens) // 128) + 1,
        eplb_config={"num_redundant_experts": args.redundant, "window_size": args.window,
                     "step_interval": args.step_interval}), weights=weights)
    generator = torch.Generator().manual_seed(1)
    for i in range(args.requests):
        prompt = torch.randint(2, config["vocab_size"], (args.prompt,), generator=generator).tolist()
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    rebalances, start = [], time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            engine.step()
            eplb = engine.stats().get("eplb")
            if eplb and eplb["num_rebalances"] > len(rebalances):
                rebalances.append(eplb)
        wall = time.perf_counter() - start
        stats = engine.stats()
    finally:
        engine.shutdown()
    per_dp = stats.get("data_parallel", [stats])
    rows = []
    for report in stats["ranks"]:
        dp = stats_for_rank(per_dp, report["rank"], args.ranks)
        tokens = dp["num_prefill_tokens"] + dp["num_decode_tokens"]
        rows.append({"rank": report["rank"], "device": args.device, "tokens": tokens,
                     "tok_s": round(tokens / wall, 1), "steps": report["num_steps"],
                     "step_s": round(report["step_s"], 4), "dispatch_s": round(report["dispatch_s"], 4),
                     "dispatch_share": round(report["dispatch_s"] / report["step_s"], 3) if report["step_s"] else None})
    first, second = (rebalances + [None, None])[:2]
    rows.append({"balance_initial": first and round(first["balance_before"], 3),
                 "balance_predicted": first and round(first["balance_after"], 3),
                 "balance_measured_after": second and round(second["balance_before"], 3),
                 "rebalances": len(rebalances), "pause_ms": [round(r["pause_s"] * 1e3, 1) for r in rebalances],
                 "wall_s": round(wall, 2), "ranks": args.ranks, "experts": args.experts,
                 "redundant": args.redundant})
    return rows


def stats_for_rank(per_dp: list[dict], rank: int, num_ranks: int) -> dict:
    """The DP rank's counters (each rank is its own DP rank here: TP = CP = 1)."""
    return per_dp[rank] if len(per_dp) == num_ranks else per_dp[0]


def main(argv=None) -> None:
    for row in run(parse_args(argv)):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
