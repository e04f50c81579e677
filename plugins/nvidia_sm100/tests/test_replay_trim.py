"""Exact replay after a prefix hit on an NVIDIA GPU, through the plugin's default (not batch-invariant)
kernels: each layer runs only the replay rows it needs (`deepinfer_core/models/row_trim.py`), and the
warm answers are the cold run's. Needs a CUDA device of compute capability >= 9.0 and the plugin."""

from __future__ import annotations

import json

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config
from deepinfer_core.testing.serving import record_attention_rows, serve

CONFIG = tiny_config("hca128", index_n_heads=32)  # window 16, CSA rate 4, HCA rate 128, 3 layers
WEIGHTS = random_state_dict(CONFIG, seed=11)


def prompts(lengths, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, CONFIG["vocab_size"], (n,), generator=generator).tolist() for n in lengths]


SHARED = prompts([300], seed=1)[0]
BATCH = [SHARED + suffix for suffix in prompts([20, 35, 50, 7], seed=2)]


def make_engine(tmp_path, **options) -> Engine:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    config = EngineConfig(model=str(tmp_path), dtype="float32", device="cuda", max_num_seqs=8, num_kv_blocks=64,
                          **options)
    return Engine(config, weights=WEIGHTS)


def generate(engine: Engine, batch: list[list[int]], tag: str) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = serve(engine, batch, params, [f"{tag}-{i}" for i in range(len(batch))])
    return [(list(c.token_ids), [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)])
            for c in (out.outputs[0] for out in outputs)]


def test_trimmed_replay_gives_the_cold_answers(cuda_device, tmp_path) -> None:
    cold = generate(make_engine(tmp_path), BATCH, "cold")
    engine = make_engine(tmp_path, enable_prefix_caching=True, max_num_batched_tokens=128)
    generate(engine, [SHARED + [9, 9]], "warm-up")
    rows = record_attention_rows(engine)
    warm = generate(engine, BATCH, "warm")
    assert engine.stats()["prefix_cache_hit_tokens"] >= 4 * 256
    window = CONFIG["sliding_window"]  # every request's replay: one window fewer a layer up
    assert [len(rows[0]) - len(seen) for seen in rows] == [4 * i * window for i in range(len(rows))]
    for (tokens, logprobs), (cold_tokens, cold_logprobs) in zip(warm, cold):
        assert tokens == cold_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, cold_logprobs)) < 1e-4  # other step shapes, fp32
