"""Load-time cost of hashing the weights for the cache fingerprint (issue 43 item 2).

Builds a DeepSeek-V4-shaped checkpoint of random bf16 weights (tiny attention, wide routed experts, so the
bytes are where a real checkpoint has them), then loads it with the checkpoint loader the engine uses
(`load_weights`) with and without a `WeightDigest`, alternating, page cache warm; prints the median of
each, the extra seconds and the hashing rate. Run: `python bench/weight_digest.py [--hidden 2048 ...]`.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.models.loading.weight_digest import WeightDigest
from deepinfer_core.models.loading.weights import load_weights
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config, write_checkpoint


def build(directory: Path, hidden: int, experts: int, width: int, vocab: int, shards: int) -> Path:
    config = tiny_config(hidden_size=hidden, n_routed_experts=experts, moe_intermediate_size=width, vocab_size=vocab)
    weights = random_state_dict(config, seed=0)
    return write_checkpoint(directory, config, weights, dtype=torch.bfloat16, shards=shards)


def load_seconds(model_dir: Path, config: ModelConfig, digest: WeightDigest | None) -> float:
    start = time.perf_counter()
    weights = load_weights(model_dir, config, torch.bfloat16, progress=False, digest=digest)
    if digest is not None:
        digest.digest()
    seconds = time.perf_counter() - start
    del weights
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--width", type=int, default=2048, help="moe_intermediate_size")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="hashing threads (default: the digest's own)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp), args.hidden, args.experts, args.width, args.vocab, args.shards)
        size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
        config = ModelConfig.from_dir(model_dir)
        load_seconds(model_dir, config, None)  # warm the page cache
        plain, hashed = [], []
        for _ in range(args.repeats):
            plain.append(load_seconds(model_dir, config, None))
            hashed.append(load_seconds(model_dir, config, WeightDigest(args.threads)))
    base, with_digest = statistics.median(plain), statistics.median(hashed)
    print(f"checkpoint {size / 2**30:.2f} GiB in {args.shards} shards; load_weights median of {args.repeats}: "
          f"{base:.2f} s plain, {with_digest:.2f} s hashed (+{with_digest - base:.2f} s, "
          f"{100 * (with_digest / base - 1):+.1f}%); {size / 2**30 / max(with_digest - base, 1e-9):.2f} GiB/s of "
          f"extra time; every run: plain {[round(s, 2) for s in plain]}, hashed {[round(s, 2) for s in hashed]}")
    data = torch.empty(size // 4 if size < 2**31 else 2**29, dtype=torch.int32).view(torch.uint8)
    start = time.perf_counter()
    single = WeightDigest(1)
    single.add("x", data)
    single.digest()
    one = time.perf_counter() - start
    blake = time.perf_counter()
    hashlib.blake2b(memoryview(data.numpy())).digest()
    blake = time.perf_counter() - blake
    print(f"one thread alone on {data.numel() / 2**30:.2f} GiB: SHA-256 (the digest's) {data.numel() / 2**30 / one:.2f} "
          f"GiB/s, BLAKE2b {data.numel() / 2**30 / blake:.2f} GiB/s")


if __name__ == "__main__":
    main()
