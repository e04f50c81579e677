"""FP4 routed experts kept in their checkpoint bytes (`quantized_weights="native"`) against the
dequantise-at-load path: the loader, the reference MoE and the whole engine on tiny quantised checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.backends import MoESpec, quant
from deepinfer_core.config import CheckpointError, ModelConfig
from deepinfer_core.models.loading.weights import load_weights
from deepinfer_core.models.tiny import tiny_config, write_checkpoint
from deepinfer_core.reference import moe as reference_moe
from deepinfer_core.testing import conformance
from deepinfer_core.testing.cases import random_moe_case

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def fp4_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("fp4"), tiny_config(), seed=1, layout="official",
                            quant="fp8+fp4")


@pytest.mark.parametrize("layout", ["official", "transformers"])
def test_keep_fp4_holds_the_packed_bytes_of_the_dequantised_weights(tmp_path, layout):
    model_dir = write_checkpoint(tmp_path, tiny_config(), seed=1, layout=layout, quant="fp8+fp4")
    config = ModelConfig.from_dir(model_dir)
    dense = load_weights(model_dir, config)
    packed = load_weights(model_dir, config, keep_fp4=True)
    expert_names = [name for name in dense if name.endswith(EXPERTS)]
    assert expert_names
    assert set(packed) == set(dense) | {f"{name}_scale" for name in expert_names}
    for name, tensor in dense.items():
        if name in expert_names:
            assert packed[name].dtype == torch.int8 and packed[f"{name}_scale"].dtype == quant.FP4_SCALE_DTYPE
            assert packed[name].shape == quant.fp4_packed_shape(tensor.shape)
            torch.testing.assert_close(quant.dequantize_fp4(packed[name], packed[f"{name}_scale"]), tensor,
                                       atol=0, rtol=0)
        else:
            assert torch.equal(packed[name], tensor), name


def test_keep_fp4_refuses_scales_that_are_not_powers_of_two(tmp_path):
    model_dir = write_checkpoint(tmp_path, tiny_config(), seed=1, layout="official", quant="fp8+fp4")
    path = next(model_dir.glob("*.safetensors"))
    tensors = load_file(path)
    name = "layers.0.ffn.experts.0.w2.scale"
    tensors[name] = tensors[name].float() * 1.5
    save_file(tensors, path)
    config = ModelConfig.from_dir(model_dir)
    load_weights(model_dir, config)  # dequantising reads any float scale
    with pytest.raises(CheckpointError, match=r"w2\.scale.*not powers of two.*dequantize"):
        load_weights(model_dir, config, keep_fp4=True)


@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("gathered", [True, False])
def test_reference_fp4_moe_equals_the_dense_reference_on_dequantised_weights(monkeypatch, num_tokens, gathered):
    spec = MoESpec(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, scoring_func="sqrtsoftplus",
                   routed_scaling_factor=1.5, swiglu_limit=7.0)
    if not gathered:
        monkeypatch.setattr(reference_moe, "GATHER_LIMIT", 0)
    x, input_ids, weights = random_moe_case(spec, num_tokens, seed=num_tokens)
    packed = conformance.fp4_moe_weights(weights)
    dense = dataclasses.replace(packed, gate_up=quant.dequantize_fp4(packed.gate_up, packed.gate_up_scale),
                                down=quant.dequantize_fp4(packed.down, packed.down_scale),
                                gate_up_scale=None, down_scale=None)
    fp4_spec = dataclasses.replace(spec, expert_format="fp4")
    got = reference_moe.ReferenceMoE(fp4_spec, torch.device("cpu")).forward(x, input_ids, packed)
    want = reference_moe.ReferenceMoE(spec, torch.device("cpu")).forward(x, input_ids, dense)
    assert torch.equal(got, want)


def _runner(llm: LLM):
    return llm.engine.executor.runner


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": list(range(50, 60))}]
    results = []
    for output in llm.generate(prompts, GREEDY, use_tqdm=False):
        completion = output.outputs[0]
        chosen = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        results.append((list(completion.token_ids), chosen))
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_fp4_experts_generate_like_dequantised_ones(fp4_dir, dtype):
    options = {"dtype": dtype, "max_model_len": 256, "num_kv_blocks": 8, "max_num_seqs": 4}
    native = LLM(str(fp4_dir), **options)
    dequantised = LLM(str(fp4_dir), quantized_weights="dequantize", **options)
    experts = _runner(native).model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.int8 and experts.down_proj_scale.dtype == quant.FP4_SCALE_DTYPE
    assert {plan.moe.expert_format for plan in _runner(native).plans} == {"fp4"}
    assert _runner(dequantised).model.model.layers[0].mlp.experts.gate_up_proj.dtype == getattr(torch, dtype)
    got, want = _generate(native), _generate(dequantised)
    for (got_ids, got_logprobs), (want_ids, want_logprobs) in zip(got, want, strict=True):
        assert got_ids == want_ids
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(want_logprobs),
                                   atol=1e-5, rtol=1e-5)


def test_native_keeps_unquantised_and_fp8_experts_dense(tmp_path):
    fp8 = write_checkpoint(tmp_path / "fp8", tiny_config(), seed=1, layout="official", quant="fp8")
    plain = write_checkpoint(tmp_path / "plain", tiny_config(), seed=1)
    for model_dir in (fp8, plain):
        llm = LLM(str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=4, max_num_seqs=2)
        assert {plan.moe.expert_format for plan in _runner(llm).plans} == {"dense"}


@pytest.mark.parametrize("mode", ["native", "dequantize"])
def test_given_packed_weights_run_as_the_mode_says(fp4_dir, mode):
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.engine import Engine
    from deepinfer_core.testing.serving import serve

    config = ModelConfig.from_dir(fp4_dir)
    packed = load_weights(fp4_dir, config, keep_fp4=True)
    engine_config = EngineConfig(model=str(fp4_dir), dtype="float32", max_model_len=128, num_kv_blocks=4,
                                 max_num_seqs=2, quantized_weights=mode)
    engine = Engine(engine_config, weights=packed)
    formats = {plan.moe.expert_format for plan in engine.executor.runner.plans}
    assert formats == ({"fp4"} if mode == "native" else {"dense"})
    reference = LLM(str(fp4_dir), dtype="float32", max_model_len=128, num_kv_blocks=4, max_num_seqs=2,
                    quantized_weights="dequantize")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [output] = serve(engine, [list(range(3, 30))], params, ["a"])
    tokens = list(output.outputs[0].token_ids)
    want = reference.generate({"prompt_token_ids": list(range(3, 30))}, params, use_tqdm=False)
    assert tokens == list(want[0].outputs[0].token_ids)


def test_a_backend_that_does_not_declare_fp4_is_refused_for_fp4_specs():
    from deepinfer_core.backends.moe import check_expert_format

    spec = MoESpec(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, scoring_func="sigmoid",
                   routed_scaling_factor=1.0, swiglu_limit=0.0)

    class DenseOnly:
        supports_cuda_graphs = False

    check_expert_format(DenseOnly(), spec)
    with pytest.raises(ValueError, match=r"DenseOnly was built for 'fp4' experts.*dequantize"):
        check_expert_format(DenseOnly(), dataclasses.replace(spec, expert_format="fp4"))
    check_expert_format(reference_moe.ReferenceMoE(dataclasses.replace(spec, expert_format="fp4"), "cpu"),
                        dataclasses.replace(spec, expert_format="fp4"))
