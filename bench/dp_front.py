"""The data-parallel front end's host time per step, DP 2 against DP 4, on the CPU.

    python bench/dp_front.py [--ranks 2 4] [--requests 64] [--prompt 16] [--new-tokens 8] [--expert-parallel]

Runs the tiny DeepSeek-V4 (random weights) with `data_parallel_size` = each of `--ranks`: one engine
core process per DP rank, many short requests (all queued first, then stepped to the end). The front
end's `step()` is timed on the host with its waits for the cores' sockets left out
(`DataParallelEngine.host_s`): routing and merging only. Printed, one JSON line per DP size: the
front end's host microseconds per `step()` call and per core step it merged (a core's step outputs
arrive as one message), the numbers of each, and the wall time. The front end touches one socket
whatever the number of ranks, so both figures should stay flat from DP 2 to DP 4.
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
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="DP sizes to compare (default 2 4)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--expert-parallel", action="store_true", help="experts spread over the DP ranks")
    return parser.parse_args(argv)


def run(args, ranks: int, config: dict, weights: dict[str, torch.Tensor]) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="dp_front_"))
    (directory / "config.json").write_text(json.dumps(config))
    engine = build_engine(EngineConfig(
        model=str(directory), dtype="float32", device="cpu", data_parallel_size=ranks,
        enable_expert_parallel=args.expert_parallel, max_num_seqs=args.requests,
        num_kv_blocks=args.requests + 1), weights=weights)
    generator = torch.Generator().manual_seed(1)
    try:
        start = time.perf_counter()
        for i in range(args.requests):
            prompt = torch.randint(2, config["vocab_size"], (args.prompt,), generator=generator).tolist()
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=args.new_tokens,
                                                              ignore_eos=True))
        num_outputs = 0
        while engine.has_unfinished_requests():
            num_outputs += len(engine.step())
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    return {"data_parallel_size": ranks, "expert_parallel": args.expert_parallel,
            "host_us_per_step": round(engine.host_s / engine.num_steps * 1e6, 1),
            "host_us_per_core_step": round(engine.host_s / engine.num_core_steps * 1e6, 1),
            "steps": engine.num_steps, "core_steps": engine.num_core_steps, "outputs": num_outputs,
            "wall_s": round(wall, 2)}


def main(argv=None) -> None:
    args = parse_args(argv)
    config = tiny_config("sliding_csa_hca", index_n_heads=16)
    weights = random_state_dict(config, seed=0)
    for ranks in args.ranks:
        print(json.dumps(run(args, ranks, config, weights)), flush=True)


if __name__ == "__main__":
    main()
