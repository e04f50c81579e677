"""FP8 projections kept in their checkpoint bytes (`quantized_weights="native"`): the loader, the model's
`FP8Linear`s on the linear backend, and the whole engine against the dequantise-at-load path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.backends import quant
from deepinfer_core.config import ModelConfig
from deepinfer_core.models.deepseek_v4.layers import FP8Linear
from deepinfer_core.models.loading import weight_formats
from deepinfer_core.models.loading.checkpoint_layout import meta_model
from deepinfer_core.models.loading.weights import load_weights
from deepinfer_core.models.tiny import tiny_config, write_checkpoint
from tests.models.test_weight_formats import _generate, _runner

OPTIONS = {"max_model_len": 256, "num_kv_blocks": 8, "max_num_seqs": 4}
FP8_PROJECTIONS = {  # what DeepSeek ships in FP8 (the tiny writer quantises the same ones)
    "q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "gate_proj", "up_proj", "down_proj",
}


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """V4's layout (128x128 float32 scales, FP8 experts) and V4.1's (32x32 ue8m0 scales, FP4 experts)."""
    return {
        "v4": write_checkpoint(tmp_path_factory.mktemp("v4"), tiny_config(), seed=1, layout="official",
                               quant="fp8"),
        "v41": write_checkpoint(tmp_path_factory.mktemp("v41"), tiny_config(), seed=1, layout="official",
                                quant="fp8+fp4", fp8_block=(32, 32)),
    }


@pytest.mark.parametrize("kind", ["v4", "v41"])
def test_keep_fp8_holds_the_bytes_of_the_dequantised_weights(fp8_dirs, kind):
    config = ModelConfig.from_dir(fp8_dirs[kind])
    block = weight_formats.fp8_layout(config)[0]
    names = weight_formats.fp8_projection_names(meta_model(config))
    dense = load_weights(fp8_dirs[kind], config)
    kept = load_weights(fp8_dirs[kind], config, keep_fp8=names)
    fp8_names = [name for name in kept if f"{name}_scale" in kept]
    assert {name.split(".")[-2] for name in fp8_names} == FP8_PROJECTIONS
    assert set(kept) == set(dense) | {f"{name}_scale" for name in fp8_names}
    for name in fp8_names:
        assert kept[name].dtype == quant.FP8_DTYPE and kept[f"{name}_scale"].dtype == torch.float32
        assert torch.equal(quant.dequantize_fp8(kept[name], kept[f"{name}_scale"], block), dense[name]), name


@pytest.mark.parametrize(("kind", "dtype"), [("v4", "float32"), ("v41", "bfloat16")])
def test_native_fp8_projections_generate_like_dequantised_ones(fp8_dirs, kind, dtype):
    native = LLM(str(fp8_dirs[kind]), dtype=dtype, **OPTIONS)
    dequantised = LLM(str(fp8_dirs[kind]), dtype=dtype, quantized_weights="dequantize", **OPTIONS)
    model = _runner(native).model
    held = {name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert held == FP8_PROJECTIONS
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.q_a_proj, FP8Linear) and attn.q_a_proj.weight.dtype == quant.FP8_DTYPE
    assert type(attn.compressor.kv_proj) is nn.Linear  # shipped in bf16, stays dense
    expected_block = (32, 32) if kind == "v41" else (128, 128)
    assert attn.q_a_proj.spec.block == expected_block
    assert attn.q_a_proj.spec.scale_format == ("ue8m0" if kind == "v41" else "float32")
    assert type(attn.q_a_proj.backend).__name__ == "ReferenceLinear"
    assert not any(isinstance(m, FP8Linear) for m in _runner(dequantised).model.modules())
    got, want = _generate(native), _generate(dequantised)
    for (got_ids, got_logprobs), (want_ids, want_logprobs) in zip(got, want, strict=True):
        assert got_ids == want_ids
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=1e-4)


def test_a_bf16_checkpoint_builds_the_model_it_built_before(tmp_path):
    plain = write_checkpoint(tmp_path, tiny_config(), seed=1, dtype=torch.bfloat16)
    llm = LLM(str(plain), **OPTIONS)
    model = _runner(llm).model
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    assert _runner(llm).linear_backends == []
    reference = meta_model(ModelConfig.from_dir(plain), torch.bfloat16)
    assert [type(m) for m in model.modules()] == [type(m) for m in reference.modules()]


@pytest.mark.parametrize("mode", ["native", "dequantize"])
def test_given_fp8_weights_run_as_the_mode_says(fp8_dirs, mode):
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.engine import Engine
    from deepinfer_core.testing.serving import serve

    model_dir = fp8_dirs["v41"]
    config = ModelConfig.from_dir(model_dir)
    weights = load_weights(model_dir, config, keep_fp4=True,
                           keep_fp8=weight_formats.fp8_projection_names(meta_model(config)))
    engine_config = EngineConfig(model=str(model_dir), dtype="float32", quantized_weights=mode, **OPTIONS)
    engine = Engine(engine_config, weights=weights)
    held = any(isinstance(m, FP8Linear) for m in engine.executor.runner.model.modules())
    assert held == (mode == "native")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [output] = serve(engine, [list(range(3, 30))], params, ["a"])
    tokens = list(output.outputs[0].token_ids)
    reference = LLM(str(model_dir), dtype="float32", quantized_weights="dequantize", **OPTIONS)
    want = reference.generate({"prompt_token_ids": list(range(3, 30))}, params, use_tqdm=False)
    assert tokens == list(want[0].outputs[0].token_ids)


def test_quantization_keeps_the_checkpoints_precision_or_says_what_is_missing(fp8_dirs, tmp_path):
    llm = LLM(str(fp8_dirs["v4"]), dtype="float32", quantization="fp8", **OPTIONS)
    assert any(isinstance(m, FP8Linear) for m in _runner(llm).model.modules())
    plain = ModelConfig.from_dir(write_checkpoint(tmp_path, tiny_config(), seed=1))
    weight_formats.check_quantization(None, plain)
    with pytest.raises(NotImplementedError, match="unquantised checkpoint"):
        weight_formats.check_quantization("fp8", plain)
    with pytest.raises(NotImplementedError, match="'awq'"):
        weight_formats.check_quantization("awq", ModelConfig.from_dir(fp8_dirs["v4"]))
