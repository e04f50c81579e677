"""V4.1's nested config.json and flat inference/config.json, and the released tensor list derived from it."""

from __future__ import annotations

import inspect
import json

import pytest

from deepinfer_core.config import ConfigError, FamilyConfig, ModelConfig
from deepinfer_core.models import registry, tensor_parallel
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.release import released_tensors

QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
         "weight_block_size": [32, 32], "expert_dtype": "fp4"}
# research-v41.md §2: the release's config.json, key by key
TEXT = {
    "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024, "max_position_embeddings": 1048576,
    "sliding_window": 128, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20, "candidate_block_size": 8, "candidate_topk_blocks": 2048,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 384,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hidden_act": "silu", "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682], "engram_head_dim": 256, "engram_n_heads": 8,
    "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 2, "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_markov_rank": 256,
    "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39], "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3, "rms_norm_eps": 1e-20, "attention_bias": False, "attention_dropout": 0.0,
    "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
}
RELEASE = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264,
    "quantization_config": QUANT, "text_config": TEXT,
    "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024,
                      "num_attention_heads": 16, "intermediate_size": 2816, "patch_size": 14, "downsample_ratio": 3,
                      "rope_theta": 10000, "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None},
}
# the reference's inference/config.json (DeepSeek's flat names), as the release ships it
INFERENCE = {
    "vocab_size": 129280, "dim": 5120, "moe_inter_dim": 2304, "n_layers": 40, "n_mtp_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3, "n_heads": 64,
    "n_routed_experts": 384, "n_shared_experts": 1, "n_activated_experts": 6, "score_func": "sqrtsoftplus",
    "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1280, "head_dim": 512, "rope_head_dim": 64,
    "norm_eps": 1e-20, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36], "original_seq_len": 65536, "rope_theta": 10000,
    "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 32, "index_head_dim": 128,
    "index_topk": 512, "candidate_source_layer": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "engram_layer_ids": [1, 14],
    "engram_vocab_size": 16000000, "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_pad_id": 2, "engram_compressed_vocab_size": 99092, "dtype": "fp8", "expert_dtype": "fp4",
    "compress_rope_theta": 160000, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "vision_n_layers": 32, "vision_dim": 1024, "vision_n_heads": 16, "vision_inter_dim": 2816,
    "vision_patch_size": 14, "vision_downsample_ratio": 3, "vision_max_n_token": 1024, "vision_min_pixels": 295936,
    "vision_max_wh_ratio": None, "image_token_id": 129264, "engram_n_heads": 8, "engram_head_dim": 256,
    "vision_rope_theta": 10000,
}


def test_the_released_config_reads_and_its_tensor_list_has_the_release_count_and_bytes():
    config = V41Config.from_dict(RELEASE)
    assert (config.hidden_size, config.num_hidden_layers, config.rms_norm_eps) == (5120, 40, 1e-20)
    assert config.fp8_block == (32, 32) and config.expert_dtype == "fp4"
    tensors = released_tensors(config)
    assert len(tensors) == 96085
    assert sum(t.num_bytes for t in tensors) == 510_286_023_000
    assert len({t.name for t in tensors}) == len(tensors)
    by_name = {t.name: t for t in tensors}
    assert by_name["layers.20.attn.compressor.wkv.weight"].shape == (512, 5120)
    assert "layers.20.attn.compressor.wgate.weight" not in by_name and "layers.14.attn.compressor.wgate.weight" in by_name
    assert by_name["layers.0.ffn.experts.0.w2.weight"].dtype == "I8" and by_name["layers.0.ffn.experts.0.w2.weight"].shape == (5120, 1152)
    assert by_name["layers.24.attn.indexer.wq_b.scale"].shape == (128, 40) and "layers.24.attn.indexer.wk.weight" not in by_name
    assert by_name["layers.14.engram.embed.weight"].shape == (384016682, 256)


def test_the_flat_inference_config_gives_the_same_model():
    nested, flat = V41Config.from_dict(RELEASE), V41Config.from_inference_dict(INFERENCE)
    skip = {"vision_config", "quantization_config", "architectures"}
    assert flat.model_dump(exclude=skip) == nested.model_dump(exclude=skip)
    assert flat.quantization_config.expert_dtype == "fp4" and flat.fp8_block == (32, 32)
    with pytest.raises(ConfigError, match="unknown key 'dimension'"):
        V41Config.from_inference_dict({**INFERENCE, "dimension": 1})


@pytest.mark.parametrize("field, value, message", [
    ("compress_ratios", [0, 0] + [2] * 18 + [1] * 20, "compress_ratios has 40 entries"),
    ("kv_source_layer_ids", [2, 8, 14], "kv_source_layer_ids: layer 20 .ratio 1. would read layer 14"),
    ("index_source_layer_ids", [2, 8, 20, 24], "kv_source_layer_ids must all be index sources"),
    ("candidate_source_layer_id", 21, "candidate_source_layer_id 21 is not an index source"),
    ("engram_num_embeddings", [1], "engram_num_embeddings has 1 entries"),
    ("hidden_size", 0, "hidden_size"),
    ("scoring_func", "relu", "scoring_func"),
    ("engram_layer_ids", [14, 1], "engram_layer_ids"),
])
def test_a_bad_value_names_its_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        V41Config.from_dict({**RELEASE, "text_config": {**TEXT, field: value}})


def test_the_registry_reads_v41_and_the_v4_config_points_at_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASE))
    config = registry.load_model_config(tmp_path)
    assert isinstance(config, V41Config) and config.model_type == "deepseek_v41"
    assert registry.model_class(config).__name__ == "DeepseekV41ForCausalLM"
    with pytest.raises(ConfigError, match="V41Config"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ConfigError, match="text_config"):
        V41Config.from_dict({k: v for k, v in RELEASE.items() if k != "text_config"})


def test_v41_declares_its_capabilities_and_shares_the_family_fields_with_v4():
    config = V41Config.from_dict(RELEASE)
    capabilities = config.capabilities
    assert capabilities.tensor_parallel and capabilities.expert_parallel  # tests/engine/test_v41_{tp,ep}_engine.py
    assert not capabilities.context_parallel
    assert capabilities.swa_replay_default == "bounded" == V41Config.swa_replay_default
    assert capabilities.has_checkpoint_loader and capabilities.can_trim_decoder
    # its `mtp.*` slot holds DSpark: 5 drafts a block at the release; a config without stages carries none
    assert capabilities.drafters == ("dspark",) and capabilities.dspark_block_size == 5
    bare = V41Config.from_dict({**RELEASE, "text_config": {**TEXT, "num_nextn_predict_layers": 0,
                                                           "compress_ratios": TEXT["compress_ratios"][:40]}})
    assert bare.capabilities.drafters == () and bare.capabilities.dspark_block_size == 0
    assert capabilities.has_engram and config.has_engram
    assert not V41Config.from_dict({**RELEASE, "text_config": {**TEXT, "engram_layer_ids": [],
                                                               "engram_num_embeddings": []}}).has_engram
    # one definition of the shared fields: both classes take them from FamilyConfig
    shared = set(FamilyConfig.model_fields)
    assert {"vocab_size", "sliding_window", "hc_mult", "quantization_config"} <= shared
    for name in shared:
        assert name not in inspect.get_annotations(V41Config) and name not in inspect.get_annotations(ModelConfig)
        assert repr(V41Config.model_fields[name]) == repr(ModelConfig.model_fields[name])


def test_a_family_without_a_parallelism_refuses_it_naming_the_size_and_the_family():
    capabilities = V41Config.from_dict(RELEASE).capabilities
    capabilities.check_parallel("deepseek_v41", "tensor", 1)  # one rank is no parallelism
    capabilities.check_parallel("deepseek_v41", "expert", 2)  # implemented
    with pytest.raises(NotImplementedError, match=r"context_parallel_size=2 for 'deepseek_v41'"):
        capabilities.check_parallel("deepseek_v41", "context", 2)
    # tensor parallelism is implemented: the release splits over 8 ranks (64 heads, 8 output groups, FP4
    # expert width 2304 / 8 = 9 x 32), not over 16 (a rank would hold half an output group)
    tensor_parallel.check_tensor_parallel(V41Config.from_dict(RELEASE), 8)
    with pytest.raises(ConfigError, match=r"o_groups \(8\) is not a multiple of tensor_parallel_size \(16\)"):
        tensor_parallel.check_tensor_parallel(V41Config.from_dict(RELEASE), 16)
