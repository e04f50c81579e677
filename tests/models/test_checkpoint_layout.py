import pytest
import torch
import transformers

from deepinfer_core.config import CSA, HCA, SLIDING, ModelConfig
from deepinfer_core.models.checkpoint_layout import (
    CheckpointError,
    detect_layout,
    expected_tensors,
    is_fp32_tensor,
    source_plans,
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


def test_fp32_tensors_match_transformers_keep_list():
    assert is_fp32_tensor("model.layers.3.attn_hc.fn")
    assert is_fp32_tensor("model.hc_head.hc_scale")
    assert is_fp32_tensor("model.layers.0.self_attn.sinks")
    assert is_fp32_tensor("model.layers.1.self_attn.compressor.indexer.position_bias")
    assert is_fp32_tensor("model.layers.1.self_attn.compressor.kv_norm.weight")
    assert is_fp32_tensor("model.norm.weight")
    assert not is_fp32_tensor("model.layers.0.self_attn.q_b_proj.weight")
    assert not is_fp32_tensor("model.layers.0.mlp.experts.gate_up_proj")
    assert not is_fp32_tensor("lm_head.weight")


def test_sliding_only_model_has_no_compressor_tensors():
    config = ModelConfig.from_dict(tiny_config("sliding_only", layer_types=[SLIDING, SLIDING]))
    assert not any("compressor" in name for name in expected_tensors(config))
