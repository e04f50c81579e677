"""Quantised tiny checkpoints (FP8 projections with 32x32 UE8M0 tiles, packed FP4 experts) on the plugin: V4's
layout, and V4.1's as released (its FP8 projections kept FP8: attention, indexers' wq_b, shared experts,
Engram's wkv).

1. Any machine (Triton's interpreter off the GPU): the model with the plugin's FP8 GEMM in every FP8
   projection gives every position's logprobs of the same model whose projections quantise their
   activations in torch (`quant.quantize_activations_fp8`) and multiply the dequantised values: the
   kernel computes exactly that, up to the order of fp32 additions.
2. GPU only: the whole engine on the plugin's backends (FP8 GEMMs, FP4 MoE kernels, CUDA graphs) against
   the reference backends on the same checkpoint: in fp32 a reference computing the same W8A8 products
   (activations quantised in torch), in bf16 the plain reference (activations not quantised). Greedy
   tokens agree, with their logprobs, and where they part the reference itself calls it a near tie (its
   logprobs of the two tokens within `NEAR_TIE`). On random tiny weights the next-token distribution
   is nearly flat, so near ties are common; test 1 is the exact one.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.backends import quant
from deepinfer_core.config import EngineConfig
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.models import registry
from deepinfer_core.models.deepseek_v4.layers import FP8Linear
from deepinfer_core.models.tiny import tiny_config, write_checkpoint
from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint
from deepinfer_core.reference.linear import ReferenceLinear
from deepinfer_core.testing.serving import serve
from deepinfer_core.worker.runner import ModelRunner
from tests.oracle import run_chunked

NEAR_TIE = 0.1
"""Largest reference logprob gap at which the two backends may pick different greedy tokens. Quantising
activations to e4m3 turns an upstream difference in the last bit (another order of additions) into a
whole e4m3 step of one input, so even in fp32 two correct engines part where the top two tokens are
this close; on the H200, bf16 engines on this checkpoint parted at a gap of 0.059."""


class EmulatedW8A8(ReferenceLinear):
    """The reference with activations quantised as the FP8 GEMM quantises them (oracle of test 1)."""

    def forward(self, x, weight, scale):
        flat = x.reshape(x.shape[0], -1)
        q, scales = quant.quantize_activations_fp8(flat, 128, self.spec.scale_format == "ue8m0")
        dequantised = q.float() * scales.repeat_interleave(128, dim=-1)[:, : flat.shape[1]]
        return super().forward(dequantised.to(x.dtype).view_as(x), weight, scale)


class LinearEverywhere:
    """Serves one linear class on any device (the plugin itself declines off CUDA)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    @hookimpl
    def make_linear(self, spec, device):
        if self.kind == "triton":
            from deepinfer_nvidia_sm100.linear import TritonFP8Linear

            return TritonFP8Linear(spec, num_sms=4)
        return EmulatedW8A8(spec, device)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config(moe_intermediate_size=64)
    return write_checkpoint(tmp_path_factory.mktemp("fp8fp4"), config, seed=3, layout="official",
                            quant="fp8+fp4", fp8_block=(32, 32))


@pytest.fixture(scope="module")
def v41_checkpoint(tmp_path_factory):
    return write_v41_checkpoint(tmp_path_factory.mktemp("v41fp8fp4"), tiny_v41_config(), seed=3)


# V4's layout (`checkpoint`) and V4.1's (`v41_checkpoint`), both with 32x32 UE8M0 FP8 tiles


def _runner(checkpoint, device) -> ModelRunner:
    model_config = registry.load_model_config(checkpoint)
    engine_config = EngineConfig(model=str(checkpoint), dtype="float32", max_num_seqs=4, num_kv_blocks=40,
                                 enforce_eager=True).resolve(model_config)
    return ModelRunner(model_config, engine_config, device)


def test_every_position_matches_activation_quantisation_in_torch(kernel_device, isolated_plugin_manager,
                                                                  checkpoint):
    from deepinfer_nvidia_sm100.linear import TritonFP8Linear

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=generator).tolist() for n in (1, 9, 20)]
    results = {}
    for kind in ("triton", "torch"):
        registered = LinearEverywhere(kind)
        isolated_plugin_manager.register(registered, name=f"linear-{kind}")
        runner = _runner(checkpoint, kernel_device)
        kinds = {type(m.backend) for m in runner.model.modules() if isinstance(m, FP8Linear)}
        assert kinds == {TritonFP8Linear if kind == "triton" else EmulatedW8A8}
        results[kind] = run_chunked(runner, prompts, 10)
        isolated_plugin_manager.unregister(registered)
    for mine, expected in zip(results["triton"], results["torch"], strict=True):
        assert torch.equal(mine.argmax(-1), expected.argmax(-1))
        assert (mine - expected).abs().max().item() < 1e-4


def test_every_v41_fp8_projection_on_the_gemm_matches_torch_and_the_dequantised_reference(
        kernel_device, isolated_plugin_manager, v41_checkpoint):
    """V4.1 loaded with the plugin's GEMM in every FP8 projection (attention, the indexers' wq_b, shared
    experts, Engram's wkv: its 32x32 UE8M0 tiles, wo_a's groups): on each kind's own FP8 weights, the
    kernel gives test 1's torch W8A8 products (1e-4) and the dequantised reference within the FP8 bound
    (`conformance.check_linear`). Test 1 itself is not run on V4.1: through its nine layers and the
    indexers' discrete top-k picks, an e4m3 step flipped by the order of fp32 additions moves later
    positions' logprobs by more than 1e-4 (test 2 bounds the whole engine)."""
    from deepinfer_nvidia_sm100.linear import TritonFP8Linear

    from deepinfer_core.testing import conformance

    registered = LinearEverywhere("triton")
    isolated_plugin_manager.register(registered, name="linear-triton")
    runner = _runner(v41_checkpoint, kernel_device)
    isolated_plugin_manager.unregister(registered)
    kinds = {}
    for name, module in runner.model.named_modules():
        if isinstance(module, FP8Linear):
            kinds.setdefault(module.spec, (name, module))
    assert {name.rsplit(".", 1)[-1] for name, _ in kinds.values()} >= {"wq_a", "wq_b", "wkv", "wo_a", "w2"}
    assert any(".engram." in name for name, _ in kinds.values())
    assert any(spec.groups > 1 for spec in kinds)
    generator = torch.Generator().manual_seed(2)
    for spec, (name, module) in kinds.items():
        assert isinstance(module.backend, TritonFP8Linear) and spec.block == (32, 32), name
        assert spec.scale_format == "ue8m0", name
        shape = (-1, spec.groups, spec.in_features) if spec.groups > 1 else (-1, spec.in_features)
        for num_tokens in (1, 9, 20):
            x = torch.randn(num_tokens * spec.groups * spec.in_features, generator=generator).view(shape)
            got = module(x.to(kernel_device)).cpu()
            want = EmulatedW8A8(spec, "cpu").forward(x, module.weight.cpu(), module.weight_scale.cpu())
            assert (got - want).abs().max().item() < 1e-4, (name, num_tokens)
        conformance.check_linear(module.backend, kernel_device, num_tokens_list=(1, 9, 20))


def _greedy(engine, prompts, max_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    return [out.outputs[0] for out in serve(engine, prompts, params)]


PROMPT_LENGTHS = (3, 17, 40, 90)
ENGINE_OPTIONS = {"max_num_seqs": 4, "max_model_len": 256, "num_kv_blocks": 32, "device": "cuda"}


def _prompts():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(2, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _plugin_engine(checkpoint, dtype, isolated_plugin_manager):
    """The engine with the plugin registered, checked to run the plugin's kernels everywhere."""
    from deepinfer_nvidia_sm100 import hooks

    from deepinfer_core.engine.engine import Engine

    isolated_plugin_manager.register(hooks, name="nvidia_sm100")
    engine = Engine(EngineConfig(model=str(checkpoint), dtype=dtype, **ENGINE_OPTIONS))
    runner = engine.executor.runner
    assert {type(m.backend).__name__ for m in runner.model.modules() if isinstance(m, FP8Linear)} == {"TritonFP8Linear"}
    assert {type(b).__name__ for b in runner.model.moe_backends} == {"TritonMoE"}
    assert runner.graphs is not None
    return engine


V41_PARTS_BEYOND_NEAR_TIES = pytest.mark.xfail(strict=True, reason=(
    "measured on an H100 (2026-12-08): V4.1's tiny checkpoint parts from the reference at gaps of 0.126 "
    "(fp32, W8A8 emulated) and 0.152 (bf16) though each FP8 projection equals the emulation (the test above); "
    "where the divergence starts (the indexers' discrete picks or the e4m3 rounding of activations) is not "
    "found yet"))


@pytest.mark.parametrize("name", ["checkpoint", pytest.param("v41_checkpoint", marks=V41_PARTS_BEYOND_NEAR_TIES)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_the_plugin_parts_from_the_reference_only_at_near_ties(cuda_device, isolated_plugin_manager,
                                                                         request, name, dtype):
    """fp32: the reference quantises activations as the kernel does (`EmulatedW8A8`); bf16: the plain
    reference (activations not quantised)."""
    from deepinfer_core.engine.engine import Engine

    checkpoint = request.getfixturevalue(name)
    prompts = _prompts()
    emulated = LinearEverywhere("torch")
    if dtype == "float32":
        isolated_plugin_manager.register(emulated, name="linear-torch")
    reference_engine = Engine(EngineConfig(model=str(checkpoint), dtype=dtype, **ENGINE_OPTIONS))
    expected_linear = EmulatedW8A8 if dtype == "float32" else ReferenceLinear
    assert {type(m.backend) for m in reference_engine.executor.runner.model.modules()
            if isinstance(m, FP8Linear)} == {expected_linear}
    reference = _greedy(reference_engine, prompts)
    if dtype == "float32":
        isolated_plugin_manager.unregister(emulated)
    got = _greedy(_plugin_engine(checkpoint, dtype, isolated_plugin_manager), prompts)
    for i, (mine, want) in enumerate(zip(got, reference, strict=True)):
        for step, (token, expected) in enumerate(zip(mine.token_ids, want.token_ids, strict=True)):
            if token != expected:
                top = want.logprobs[step]
                assert token in top, f"prompt {i} step {step}: token {token} is not in the reference's top 5"
                gap = top[expected].logprob - top[token].logprob
                assert gap < NEAR_TIE, f"prompt {i} step {step}: the reference prefers {expected} by {gap:.3f}"
                break  # the contexts differ from here on
            assert abs(mine.logprobs[step][token].logprob - want.logprobs[step][token].logprob) < NEAR_TIE
