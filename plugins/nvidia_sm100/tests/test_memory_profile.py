"""Memory honesty on the GPU: start-up measures the largest step through torch.cuda's counters and sizes
the KV cache beside it, so an engine near the device's limit either serves its largest prefill or
refuses at start-up; it never runs out of memory mid-request.

The checkpoint has packed FP4 experts wide enough that a prefill step's expert activations (the
sorted rows' SwiGLU outputs, `MOE_ACTIVATIONS`) are the largest transient; with fp32 activations the
plugin would also dequantise a layer's whole expert set for such a step (12.9 GB at V4-Flash size), which
the old estimate missed. Every engine is shut down in a `finally`, so a failure does not leave the card
full for the tests after it. Needs the plugin installed and a CUDA device of compute capability >= 9.0.
"""

from __future__ import annotations

import gc

import pytest
import torch
from deepinfer_nvidia_sm100.platform import device_problem

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.kv.cache import bytes_per_block, bytes_per_slot
from deepinfer_core.models.layer_plan import BLOCK_SIZE
from deepinfer_core.models.tiny import tiny_config, write_checkpoint
from deepinfer_core.testing.serving import serve
from deepinfer_core.worker import model_loader

EXPERTS, INTER, HIDDEN = 64, 4096, 64
CONFIG = tiny_config(n_routed_experts=EXPERTS, moe_intermediate_size=INTER)
OPTIONS = {"max_num_seqs": 4, "max_model_len": 2048, "max_num_batched_tokens": 1024, "device": "cuda",
           "dtype": "bfloat16"}
MOE_ACTIVATIONS = OPTIONS["max_num_batched_tokens"] * CONFIG["num_experts_per_tok"] * INTER * 2
"""Bytes of a full chunk's expert activations (one bf16 row of the intermediate size per routed row, before
the padding of each expert's rows): a lower bound on what the largest step holds beside the weights."""


# the checkpoint (module scope) would be written before `cuda_device` skips: skip the module at once
pytestmark = pytest.mark.skipif(device_problem() is not None, reason=f"needs a CUDA device: {device_problem()}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("fp4-wide"), CONFIG, seed=3, layout="official",
                            quant="fp8+fp4", fp8_block=(32, 32))


def _engine(checkpoint, isolated_plugin_manager, **options) -> Engine:
    from deepinfer_nvidia_sm100 import hooks

    if isolated_plugin_manager.get_plugin("nvidia_sm100") is None:
        isolated_plugin_manager.register(hooks, name="nvidia_sm100")
    return Engine(EngineConfig(model=str(checkpoint), **{**OPTIONS, **options}))


def _release(engine: Engine) -> None:
    engine.executor.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def _largest_prefill(engine: Engine) -> None:
    """The scheduler's worst step and then some: a max_model_len prompt (chunked at the token budget)
    beside max_num_seqs - 1 short ones, every one sampled with top-k, top-p and logprobs."""
    cfg = engine.config
    generator = torch.Generator().manual_seed(0)
    lengths = [cfg.max_model_len - 1] + [cfg.max_num_batched_tokens // cfg.max_num_seqs] * (cfg.max_num_seqs - 1)
    prompts = [torch.randint(2, CONFIG["vocab_size"], (n,), generator=generator).tolist() for n in lengths]
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=5, max_tokens=1, ignore_eos=True)
    outs = serve(engine, prompts, params)
    assert all(len(out.outputs[0].token_ids) == 1 for out in outs)


def test_the_measured_peak_counts_the_expert_activations(cuda_device, checkpoint, isolated_plugin_manager):
    engine = _engine(checkpoint, isolated_plugin_manager, gpu_memory_utilization=0.02)
    try:
        runner = engine.executor.runner
        profile = runner.memory_profile
        assert {type(b).__name__ for b in runner.model.moe_backends} == {"TritonMoE"}
        assert profile.measured and profile.num_tokens == OPTIONS["max_num_batched_tokens"]
        assert profile.peak_transient >= MOE_ACTIVATIONS, profile.describe()
        assert profile.graph_reserve > 0 and runner.graphs is not None  # decode graphs: their pool is set aside
        assert runner.num_blocks == model_loader.available_blocks(runner.plans, runner.dtype, runner.device,
                                                                  engine.config, profile)
        assert engine.stats()["rank_memory"][0]["step_peak_bytes"] == profile.reserved
        _largest_prefill(engine)
    finally:
        _release(engine)


def test_an_engine_near_the_limit_serves_its_largest_prefill_or_refuses_at_start_up(
        cuda_device, checkpoint, isolated_plugin_manager):
    """The device is filled with a ballast tensor until what the weights leave is the measured step, the
    request slots, one max-length request's blocks and a little more; at gpu_memory_utilization 0.97 the
    cache then takes all of it but the step's measured peak and 3 %, and the largest prefill must run."""
    probe = _engine(checkpoint, isolated_plugin_manager, gpu_memory_utilization=0.02)
    try:
        runner = probe.executor.runner
        weights, reserved = runner_info_bytes(probe), runner.memory_profile.reserved
        per_block, per_slot = bytes_per_block(runner.plans, runner.dtype), bytes_per_slot(runner.plans, runner.dtype)
    finally:
        _release(probe)
    needed = -(-OPTIONS["max_model_len"] // BLOCK_SIZE)
    room = weights + OPTIONS["max_num_seqs"] * per_slot + reserved + (needed + 4) * per_block
    free, _ = torch.cuda.mem_get_info(cuda_device)
    margin = 256 * 2**20  # what loading needs beyond the weights; the cache takes most of it
    ballast = torch.empty(free - room - margin, dtype=torch.uint8, device=cuda_device)
    try:
        near = _engine(checkpoint, isolated_plugin_manager, gpu_memory_utilization=0.97)
    except MemoryError as err:  # refusing at start-up is allowed; saying why is required
        assert "max_num_batched_tokens" in str(err) and "free after the weights" in str(err), err
    else:
        try:
            assert near.executor.runner.num_blocks >= needed
            _largest_prefill(near)  # must not raise torch.OutOfMemoryError
        finally:
            _release(near)
    finally:
        del ballast
        torch.cuda.empty_cache()


def runner_info_bytes(engine: Engine) -> int:
    """The weights' bytes the engine's rank holds (`RankMemory.weights_bytes`)."""
    return engine.executor.info.memory.weights_bytes
