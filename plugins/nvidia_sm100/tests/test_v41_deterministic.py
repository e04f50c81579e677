"""DeepSeek-V4.1 in deterministic mode on the plugin's batch-invariant kernels (`InvariantTritonAttention`,
an `IndexScorer` for the two-level indexer, and `InvariantTritonLayerOps`, whose fixed launch plan serves
the single-pass mHC boundaries): a request's logprobs at every position are bit-identical alone, beside
other requests and for any chunking of its prompt. Compiled on a GPU, interpreted by Triton on the CPU; and,
on a GPU, the engine's greedy tokens and logprobs (the sampler's invariant log-softmax) likewise."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import IndexScorer
from deepinfer_core.config import EngineConfig
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.weights import load_v41_checkpoint
from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint
from deepinfer_core.worker.runner import ModelRunner
from tests.models.test_v41_deterministic import TARGET, generate
from tests.models.v41_helpers import random_prompt, tiny_checkpoint
from tests.oracle import FakeSeq, all_position_logprobs


def build(directory, device, weights):
    """A deterministic runner (the reference's invariant MoE) whose attention and layer ops are the plugin's,
    on `weights` (`load_v41_checkpoint`'s, loaded once for every runner)."""
    from deepinfer_nvidia_sm100.invariant_attention import InvariantTritonAttention
    from deepinfer_nvidia_sm100.invariant_layer_ops import InvariantTritonLayerOps

    config = V41Config.from_dir(directory)
    engine_config = EngineConfig(model=str(directory), dtype="float32", max_num_seqs=3, num_kv_blocks=24,
                                 deterministic=True, enforce_eager=True)
    runner = ModelRunner(config, engine_config.resolve(config), device, weights=dict(weights))
    model = runner.model
    ops = InvariantTritonLayerOps(runner.model.ops.spec, device)
    model.bind_backends([InvariantTritonAttention(plan.attention) for plan in model.plans],
                        model.moe_backends, ops, device)
    assert model.ops is ops and all(isinstance(b, IndexScorer) for b in model.attention_backends)
    return runner


def run_steps(runner, prompts: list[list[int]], steps: list[list[int]]) -> list[torch.Tensor]:
    """Every position's logprobs of each prompt, computing `steps[k][i]` tokens of prompt `i` in step `k`."""
    seqs = [FakeSeq(p, slot=i, block_table=list(range(8 * i, 8 * i + 8))) for i, p in enumerate(prompts)]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    for num_new in steps:
        live = [(i, n) for i, n in enumerate(num_new) if n]
        outs = all_position_logprobs(runner, [seqs[i] for i, _ in live], [n for _, n in live])
        for (i, _), lp in zip(live, outs):
            got[i].append(lp.cpu())
    return [torch.cat(g) for g in got]


def test_v41_logprobs_are_the_same_alone_beside_others_and_chunked(kernel_device, tmp_path):
    # 3 Sinkhorn iterations (the release's 20 were a third of the interpreter's time) still run the loop; 2
    # heads, not 4 (deterministic RoPE runs a program per head row, half the interpreter's time), still more
    # than one head in a token's rows
    config = tiny_v41_config(hidden_size=32, moe_intermediate_size=32, hc_sinkhorn_iters=3, num_attention_heads=2)
    directory = write_v41_checkpoint(tmp_path / "tiny", config, seed=1)
    weights = load_v41_checkpoint(directory, V41Config.from_dict(config), torch.float32, "cpu")
    target, other = random_prompt(12, seed=1), random_prompt(4, seed=2)
    alone = run_steps(build(directory, kernel_device, weights), [target], [[12]])[0]
    beside = run_steps(build(directory, kernel_device, weights), [other, target], [[4, 12]])[1]
    # chunked prefill beside a prefill, then beside a decode step (one token), one token beside one token,
    # and one token alone
    split = run_steps(build(directory, kernel_device, weights), [target, other],
                      [[5, 2], [5, 1], [1, 1], [1, 0]])[0]
    assert torch.equal(beside, alone)
    assert torch.equal(split, alone)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def test_v41_engine_on_the_gpu_is_batch_chunk_and_prefix_invariant(cuda_device, checkpoint):
    options = {"device": "cuda", "dtype": "bfloat16"}
    (alone,), engine = generate(checkpoint, [TARGET], **options)
    model = engine.runner.model
    names = {type(b).__name__ for b in [*model.attention_backends, *model.moe_backends, model.ops, engine.runner.sampler]}
    assert names == {"InvariantTritonAttention", "InvariantTritonMoE", "InvariantTritonLayerOps", "CudaSampler"}
    assert engine.runner.sampler.spec.deterministic
    for num_others in (1, 63):
        others = [random_prompt(1 + (37 * i) % 300, seed=i) for i in range(num_others)]
        batch = others[: num_others // 2] + [TARGET] + others[num_others // 2 :]
        assert generate(checkpoint, batch, **options)[0][num_others // 2] == alone
    for chunk in (1, 7, 64):
        assert generate(checkpoint, [TARGET], max_num_seqs=1, max_num_batched_tokens=chunk, **options)[0][0] == alone
    results, cached = generate(checkpoint, [TARGET[:130], TARGET], enable_prefix_caching=True, max_num_seqs=1,
                               **options)
    assert cached.stats()["prefix_cache_hit_tokens"] >= 128 and results[1] == alone
