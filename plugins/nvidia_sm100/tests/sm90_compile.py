"""Compile every kernel a tiny model's forward launches for an H100/H200 (sm_90), on a machine without one
(and the FP4 experts' prefill kernels, which tiny forwards do not reach).

    python plugins/nvidia_sm100/tests/sm90_compile.py [v4|v4-quant|v41|v4-det|v41-det|fp4-prefill ...]

Triton's interpreter (how the kernel tests run off the GPU) executes a kernel's Python, not its
compilation: code the compiler rejects (a `str` constexpr in an `if`, an unsupported dtype in a dot, a
shape the layouts cannot take) passes there and fails on the device. This script drives the plugin's
backends on the CPU with a stand-in CUDA driver whose target is sm_90: each launch compiles the kernel
through Triton's whole pipeline (TTIR, TTGIR, LLVM, PTX, cubin with the bundled `ptxas`) and launches
nothing; new tensors are zeroed, so a kernel's output reads as zeros (valid indices) in the host code
that follows. It
prints one JSON line per model with the kernels compiled and exits non-zero on the first failure.
`test_sm90_compile.py` runs it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: kernels are compiled, not interpreted

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
COMPILED: set[str] = set()
"""The kernels launched (each compiled, or found compiled in the cache) since the last `clear()`."""


class CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: sm_90 is the target, and nothing is ever launched."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    """Compile for sm_90 (`warmup=True`: no launch)."""
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    COMPILED.add(self.fn.__name__)
    return kernel


def install() -> None:
    """The stand-in driver, compile-only launches, new tensors zeroed (a kernel's output is read as zeros,
    valid indices), and the plugin's device checks passing on the CPU."""
    driver.set_active(CompileOnlyDriver())
    JITFunction.run = _compile_only
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *args, **kwargs: empty(*args, **kwargs).zero_()
    torch.empty_like = lambda *args, **kwargs: empty_like(*args, **kwargs).zero_()
    from deepinfer_nvidia_sm100 import hooks

    hooks.device_problem = lambda device=None: None
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(multi_processor_count=132)


def forward(family: str, directory: str) -> dict:
    """Two prompts (9 and 3 tokens) in chunks of 4 on the plugin's backends (bf16): prefill steps, and a
    last step of one token (the decode path). "v4-det", "v41-det": deterministic mode (the invariant
    kernels), then one draw with logprobs through the runner's sampler (its invariant log-softmax)."""
    from deepinfer_nvidia_sm100 import hooks

    from deepinfer_core import plugins
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.models.registry import load_model_config
    from deepinfer_core.worker.runner import ModelRunner
    from tests.oracle import run_chunked

    deterministic = family.endswith("-det")
    if family.startswith("v41"):
        from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint

        write_v41_checkpoint(directory, tiny_v41_config(), seed=3)
    else:
        from deepinfer_core.models.tiny import tiny_config, write_checkpoint

        quant = "fp8+fp4" if family == "v4-quant" else None
        write_checkpoint(directory, tiny_config(moe_intermediate_size=64), seed=3, layout="official", quant=quant,
                         fp8_block=(32, 32))
    manager = plugins.build_plugin_manager(entry_points=[])
    manager.register(hooks, name="nvidia_sm100")
    plugins.get_plugin_manager = lambda: manager
    model_config = load_model_config(directory)
    engine_config = EngineConfig(model=directory, dtype="bfloat16", max_num_seqs=4, num_kv_blocks=40,
                                 enforce_eager=True, deterministic=deterministic).resolve(model_config)
    runner = ModelRunner(model_config, engine_config, torch.device("cpu"))
    backends = sorted({type(b).__name__ for b in (*runner.model.moe_backends, *runner.linear_backends)})
    if deterministic:
        backends = sorted({type(b).__name__ for b in (*runner.model.moe_backends, *runner.model.attention_backends,
                                                      runner.model.ops, runner.sampler)})
    run_chunked(runner, [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5]], 4)
    if deterministic:
        from deepinfer_core.testing.cases import random_sampling_case

        runner.sampler.sample(*random_sampling_case(runner.sampler.spec))
    return {"model": family, "backends": backends}


def fp4_prefill() -> dict:
    """The FP4 experts at prefill sizes (64 rows an expert) through each kernel that serves them (the
    default MMA tiles, and the inline-PTX widening the bench times beside them)."""
    import dataclasses

    from deepinfer_nvidia_sm100.moe import FP4_MMA_PREFILL, GemmConfig, TritonMoE

    from deepinfer_core.backends import MoESpec
    from deepinfer_core.testing import conformance
    from deepinfer_core.testing.cases import random_moe_case

    spec = MoESpec(hidden_size=256, intermediate_size=128, num_experts=4, top_k=2, scoring_func="sqrtsoftplus",
                   routed_scaling_factor=1.5, swiglu_limit=7.0, expert_format="fp4", dtype=torch.bfloat16)
    x, input_ids, weights = random_moe_case(spec, 128, seed=1)
    packed = conformance.fp4_moe_weights(weights)
    packed = dataclasses.replace(packed, router=packed.router.bfloat16())
    moe = TritonMoE(spec)
    ids, topk_weights = moe.route(x.bfloat16(), input_ids, packed)
    for kernel in ("tile", "dequant"):
        moe.experts(x.bfloat16(), ids, topk_weights, packed, GemmConfig(64, 64, 64, 4, 4, True, kernel=kernel))
    for config in (FP4_MMA_PREFILL[0], GemmConfig(64, 64, 128, 4, 3, True, kernel="mma_pairs")):
        moe.experts(x.bfloat16(), ids, topk_weights, packed, config)
    return {"model": "fp4-prefill", "backends": ["TritonMoE"]}


def main(families: list[str]) -> None:
    install()
    for family in families:
        COMPILED.clear()
        if family == "fp4-prefill":
            row = fp4_prefill()
        else:
            with tempfile.TemporaryDirectory() as directory:
                row = forward(family, directory)
        print(json.dumps({**row, "kernels": sorted(COMPILED), "target": f"sm_{TARGET.arch}",
                          "triton": triton.__version__}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["v4", "v4-quant", "v41", "v4-det", "v41-det", "fp4-prefill"])
