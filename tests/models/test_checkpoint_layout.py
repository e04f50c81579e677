import re

import pytest
import torch
import transformers

from deepinfer_core.config import CSA, HCA, SLIDING, ModelConfig
from deepinfer_core.models.loading.checkpoint_layout import (
    CheckpointError,
    detect_layout,
    expected_tensors,
    is_integer_tensor,
    meta_model,
    source_plans,
    tensor_schema,
)
from deepinfer_core.testing.checkpoints import PRESETS, tiny_config

transformers.logging.set_verbosity_error()

CONFIGS = {
    **{preset: tiny_config(preset) for preset in PRESETS},
    "hc3_two_csa": tiny_config(
        num_hidden_layers=3,
        layer_types=[CSA, CSA, HCA],
        mlp_layer_types=["moe", "hash_moe", "moe"],
        hc_mult=3,
        compress_rates={CSA: 8, HCA: 32},
        q_lora_rank=48,
        o_groups=4,
        num_attention_heads=8,
    ),
}


def transformers_state_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**config.to_hf_dict()))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_expected_tensors_equal_transformers_state_dict(config):
    config = ModelConfig.from_dict(config)
    assert expected_tensors(config) == transformers_state_shapes(config)


def test_layer_kinds_own_their_tensors():
    tensors = expected_tensors(ModelConfig.from_dict(tiny_config()))  # sliding, CSA, HCA; hash, moe, moe
    assert not any(name.startswith("model.layers.0.self_attn.compressor") for name in tensors)
    assert "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight" in tensors
    assert tensors["model.layers.1.self_attn.compressor.position_bias"] == (4, 128)  # CSA: two halves
    assert tensors["model.layers.2.self_attn.compressor.position_bias"] == (16, 64)
    assert not any(name.startswith("model.layers.2.self_attn.compressor.indexer") for name in tensors)
    assert "model.layers.0.mlp.gate.tid2eid" in tensors
    assert "model.layers.0.mlp.gate.e_score_correction_bias" not in tensors
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in tensors


def test_official_names_follow_deepseek_release():
    config = ModelConfig.from_dict(tiny_config())
    plans = source_plans(config, "official")
    assert plans["model.embed_tokens.weight"].sources == ("embed.weight",)
    assert plans["lm_head.weight"].sources == ("head.weight",)
    assert plans["model.hc_head.hc_fn"].sources == ("hc_head_fn",)
    assert plans["model.layers.1.self_attn.compressor.indexer.kv_norm.weight"].sources == (
        "layers.1.attn.indexer.compressor.norm.weight",
    )
    assert plans["model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"].sources == (
        "layers.1.attn.indexer.weights_proj.weight",
    )
    assert plans["model.layers.2.mlp.gate.e_score_correction_bias"].sources == ("layers.2.ffn.gate.bias",)
    assert plans["model.layers.0.self_attn.sinks"].sources == ("layers.0.attn.attn_sink",)
    gate_up = plans["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.sources[:2] == ("layers.0.ffn.experts.0.w1.weight", "layers.0.ffn.experts.1.w1.weight")
    assert gate_up.sources[8] == "layers.0.ffn.experts.0.w3.weight"
    assert gate_up.source_shape == (32, 64)
    saved = source_plans(config, "transformers")
    assert saved["model.layers.0.self_attn.kv_norm.weight"].sources == ("model.layers.0.attn.norm.weight",)
    assert saved["model.layers.0.attn_hc.fn"].sources == ("model.layers.0.hc_attn_fn",)


def test_every_official_name_is_distinct():
    config = ModelConfig.from_dict(tiny_config("deep"))
    for layout in ("official", "transformers"):
        sources = [s for plan in source_plans(config, layout).values() for s in plan.sources]
        assert len(sources) == len(set(sources))


def test_split_inverts_combine_with_w1_before_w3():
    config = ModelConfig.from_dict(tiny_config())
    plan = source_plans(config, "official")["model.layers.0.mlp.experts.gate_up_proj"]
    gate_up = torch.randn(8, 64, 64)
    parts = plan.split(gate_up)
    assert len(parts) == 16
    assert torch.equal(parts[3], gate_up[3, :32])  # w1 of expert 3: gate, the first half
    assert torch.equal(parts[8 + 3], gate_up[3, 32:])  # w3 of expert 3: up, the second half
    assert torch.equal(plan.combine(parts), gate_up)


def test_detect_layout():
    assert detect_layout(["model.layers.0.self_attn.q_a_proj.weight", "lm_head.weight"]) == "hf"
    assert detect_layout(["layers.0.attn.wq_a.weight", "embed.weight", "mtp.0.x"]) == "official"
    assert detect_layout(["model.layers.0.attn.wq_a.weight", "head.weight"]) == "transformers"
    with pytest.raises(CheckpointError, match="cannot tell the checkpoint layout"):
        detect_layout(["layers.0.attn.wq_a.weight", "model.layers.0.self_attn.q_a_proj.weight"])
    with pytest.raises(CheckpointError, match="cannot tell the checkpoint layout"):
        detect_layout(["something.else"])


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_fp32_tensors_are_the_ones_transformers_keeps_in_fp32(config):
    # transformers' own rule: a tensor under a module (or named) in `_keep_in_fp32_modules_strict`
    keep = transformers.DeepseekV4ForCausalLM._keep_in_fp32_modules_strict
    keep_pattern = re.compile("|".join(rf"((^|\.){module}($|\.))" for module in keep))
    schema = tensor_schema(meta_model(ModelConfig.from_dict(config), torch.bfloat16))
    fp32 = {name for name, spec in schema.items() if spec.dtype == torch.float32}
    floating = {name for name, spec in schema.items() if spec.dtype.is_floating_point}
    assert fp32 == {name for name in floating if keep_pattern.search(name)}
    assert {spec.dtype for name, spec in schema.items() if name in floating - fp32} == {torch.bfloat16}
    assert {name for name in schema if name not in floating} == {n for n in schema if is_integer_tensor(n)}
    assert {schema[n].dtype for n in schema if n not in floating} == {torch.int64}


def test_schema_follows_the_modules():
    config = ModelConfig.from_dict(tiny_config())
    model = meta_model(config, torch.float16)
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    schema = tensor_schema(model)
    assert schema["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float16
    assert schema["model.layers.0.self_attn.sinks"].dtype == torch.float32
    assert schema["model.layers.1.self_attn.compressor.position_bias"].shape == (4, 128)
    assert expected_tensors(config) == {name: spec.shape for name, spec in schema.items()}


def test_layout_says_which_tensors_may_be_quantised():
    plans = source_plans(ModelConfig.from_dict(tiny_config()), "official")
    assert plans["model.layers.0.self_attn.q_a_proj.weight"].quantised == ("fp8",)
    assert plans["model.layers.0.mlp.experts.gate_up_proj"].quantised == ("fp8", "fp4")
    assert plans["model.layers.0.mlp.experts.down_proj"].quantised == ("fp8", "fp4")
    for name in ("model.layers.0.attn_hc.fn", "model.norm.weight", "model.layers.0.self_attn.sinks",
                 "model.layers.1.self_attn.compressor.position_bias", "model.layers.0.mlp.gate.tid2eid"):
        assert plans[name].quantised == (), name
    table = plans["model.layers.0.mlp.gate.tid2eid"]
    assert table.is_integer and "I64" in table.stored_dtypes("BF16") and "BF16" not in table.stored_dtypes("BF16")
    norm = plans["model.norm.weight"]
    assert norm.stored_dtypes("BF16") == ("BF16", "F32") and norm.stored_dtypes("F32") == ("F32",)
    assert set(norm.stored_dtypes(None)) == {"F32", "BF16", "F16"}


def test_sliding_only_model_has_no_compressor_tensors():
    config = ModelConfig.from_dict(tiny_config("sliding_only", layer_types=[SLIDING, SLIDING]))
    assert not any("compressor" in name for name in expected_tensors(config))
