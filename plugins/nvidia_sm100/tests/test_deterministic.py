"""Deterministic mode on an NVIDIA GPU: a request's greedy tokens and logprobs are bit-identical alone, in
batches of any size and mix, for every prefill chunk size, after a preemption and a prefix hit, and over
100 repeated runs of a batch under changing load.

The plugin's batch-invariant kernels serve deterministic specs (`invariant_attention`: fixed key splits
folded in order, the indexer's tie-broken top-k; `invariant_moe`: one tile configuration, slot-order
combine; `invariant_layer_ops`: fixed launch plans, projections on fixed row tiles), and decode still
replays CUDA graphs. Needs a CUDA device of compute capability >= 9.0 and the plugin installed.
"""

from __future__ import annotations

import json
from itertools import count

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config
from deepinfer_core.testing.serving import serve

CONFIG = tiny_config("hca128", index_n_heads=32)  # window 16, CSA rate 4, HCA rate 128
WEIGHTS = random_state_dict(CONFIG, seed=11)
NUM_TOKENS = 8
_CALLS = count()


def prompts(lengths, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, CONFIG["vocab_size"], (n,), generator=generator).tolist() for n in lengths]


TARGET = prompts([300], seed=1)[0]


def make_engine(tmp_path, deterministic: bool = True, dtype: str = "bfloat16", **options) -> Engine:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    options = {"max_num_seqs": 256, "max_model_len": 1024, "num_kv_blocks": 600, "device": "cuda", **options}
    return Engine(EngineConfig(model=str(tmp_path), dtype=dtype, deterministic=deterministic, **options),
                  weights=WEIGHTS)


def generate(engine: Engine, batch: list[list[int]], num_tokens: int = NUM_TOKENS) -> list[tuple]:
    """`(token ids, logprobs)` per prompt, in order."""
    base = next(_CALLS)  # distinct request ids per call on a reused engine
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=0)
    outputs = serve(engine, batch, params, [f"{base}-{i}" for i in range(len(batch))])
    completions = [out.outputs[0] for out in outputs]
    return [(list(c.token_ids), [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)]) for c in completions]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: deterministic mode's GPU tests run on the H200")
    return make_engine(tmp_path_factory.mktemp("det"))


@pytest.fixture(scope="module")
def alone(engine) -> tuple:
    return generate(engine, [TARGET])[0]


def test_the_plugins_invariant_backends_serve_deterministic_specs(cuda_device, engine) -> None:
    model = engine.runner.model
    names = {type(b).__name__ for b in [*model.attention_backends, *model.moe_backends, model.ops]}
    assert names == {"InvariantTritonAttention", "InvariantTritonMoE", "InvariantTritonLayerOps"}
    assert engine.runner.graphs is not None, "deterministic decode should replay CUDA graphs"


@pytest.mark.parametrize("num_others", [1, 7, 63, 255])
def test_same_logprobs_alone_and_among_others(cuda_device, engine, alone, num_others) -> None:
    others = prompts([1 + (37 * i) % 400 for i in range(num_others)], seed=num_others)
    batch = others[: num_others // 2] + [TARGET] + others[num_others // 2 :]
    assert generate(engine, batch)[num_others // 2] == alone


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_same_logprobs_for_every_chunk_size(cuda_device, tmp_path, alone, chunk) -> None:
    chunked = make_engine(tmp_path, max_num_seqs=1, max_num_batched_tokens=chunk, num_kv_blocks=8)
    assert generate(chunked, [TARGET])[0] == alone


def test_same_logprobs_after_preemption_and_prefix_hit(cuda_device, tmp_path, alone) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "c").mkdir()
    # a 3-block pool: when the first request decodes into its second block, the newer one is preempted
    # (the host's scheduling, as in tests/engine/test_deterministic.py; 254 tokens and 4 blocks never did)
    small = make_engine(tmp_path / "p", max_num_seqs=2, max_num_batched_tokens=256, num_kv_blocks=3)
    results = generate(small, [prompts([126], seed=7)[0], TARGET])
    assert small.stats()["num_preemptions"] > 0, "the pool was meant to force a preemption"
    assert results[1] == alone
    cached = make_engine(tmp_path / "c", enable_prefix_caching=True, max_num_seqs=1)
    generate(cached, [TARGET[:260]])
    assert generate(cached, [TARGET])[0] == alone
    assert cached.stats()["prefix_cache_hit_tokens"] >= 256


def test_one_unique_output_over_100_runs_under_changing_load(cuda_device, engine) -> None:
    """The same 8 requests 100 times, each time beside a different number (0-120) and mix of others."""
    batch = prompts([5, 30, 120, 250, 500, 17, 64, 333], seed=2)
    load = torch.Generator().manual_seed(9)
    outputs = set()
    for run in range(100):
        num_others = int(torch.randint(0, 121, (1,), generator=load))
        others = prompts([int(n) for n in torch.randint(1, 400, (num_others,), generator=load)], seed=100 + run)
        results = generate(engine, batch + others, num_tokens=NUM_TOKENS)[: len(batch)]
        outputs.add(json.dumps(results))
    assert len(outputs) == 1


def test_default_mode_is_not_always_batch_invariant(cuda_device, tmp_path) -> None:
    """Guard: on the GPU the default (plugin) backends change a request's logprobs with its batch."""
    default = make_engine(tmp_path, deterministic=False)
    single = generate(default, [TARGET])[0]
    batched = [generate(default, prompts([1 + (37 * i) % 400 for i in range(n)], seed=n) + [TARGET])[-1]
               for n in (7, 63)]
    if all(b == single for b in batched):
        pytest.skip("the default backends happened to be batch-invariant for these batches on this GPU")
    assert any(b[1] != single[1] for b in batched)
