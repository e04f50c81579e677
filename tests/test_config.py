import json
import re

import pytest
import torch
import transformers
from pydantic import ValidationError

from deepinfer_core.config import CSA, HCA, SLIDING, ConfigError, EngineConfig, ModelConfig
from deepinfer_core.config.speculative import SpeculativeConfig
from deepinfer_core.models import registry
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.tiny import tiny_config

transformers.logging.set_verbosity_error()

YARN = {
    "type": "yarn",
    "factor": 16,
    "original_max_position_embeddings": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
}

PARITY_CASES = {
    "defaults": {},
    "official_flash_style": {
        "num_hidden_layers": 5,
        "compress_ratios": [0, 0, 4, 128, 4, 0],
        "num_hash_layers": 2,
        "qk_rope_head_dim": 64,
        "head_dim": 256,
        "rope_scaling": YARN,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
    },
    "scalar_rates_and_flat_yarn": {
        "num_hidden_layers": 3,
        "compress_rate_csa": 8,
        "compress_rate_hca": 64,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0},
    },
    "already_nested": {
        "num_hidden_layers": 3,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {"main": {"rope_theta": 5.0}, "compress": {"rope_type": "yarn", "factor": 2.0}},
    },
    "explicit_types_longer_than_layers": {
        "num_hidden_layers": 3,
        "layer_types": [SLIDING, CSA, HCA, SLIDING],
        "mlp_layer_types": ["moe"] * 3,
    },
    "eos_list": {"num_hidden_layers": 1, "eos_token_id": [1, 2], "partial_rotary_factor": 0.5},
}


@pytest.mark.parametrize("case", PARITY_CASES.values(), ids=PARITY_CASES.keys())
def test_normalisation_matches_transformers(case):
    expected = transformers.DeepseekV4Config(**case).to_dict()
    config = ModelConfig.from_dict(case)
    for field, value in config.model_dump(exclude={"quantization_config"}).items():
        assert value == expected[field], field
    assert config.qk_rope_head_dim == expected["qk_rope_head_dim"]


@pytest.mark.parametrize("case", PARITY_CASES.values(), ids=PARITY_CASES.keys())
def test_to_hf_dict_round_trips_through_transformers(case):
    config = ModelConfig.from_dict(case)
    rebuilt = transformers.DeepseekV4Config(**config.to_hf_dict()).to_dict()
    for field, value in config.model_dump(exclude={"quantization_config"}).items():
        assert value == rebuilt[field], field


def test_every_transformers_field_is_modelled():
    hf_fields = set(transformers.DeepseekV4Config.__annotations__)
    assert hf_fields <= set(ModelConfig.model_fields)


def test_legacy_keys_fold_into_modern_fields():
    config = ModelConfig.from_dict(PARITY_CASES["official_flash_style"])
    assert config.layer_types == [SLIDING, SLIDING, CSA, HCA, CSA]
    assert config.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe", "moe"]
    assert config.qk_rope_head_dim == 64 and config.partial_rotary_factor == 0.25
    assert config.rope_parameters["main"] == {
        "rope_type": "default",
        "rope_theta": 10000,
        "partial_rotary_factor": 0.25,
    }
    compress = config.rope_parameters["compress"]
    assert compress["rope_type"] == "yarn" and compress["attention_factor"] == 1.0
    assert compress["rope_theta"] == 160000 and compress["factor"] == 16
    assert [config.compress_rate(i) for i in range(5)] == [0, 0, 4, 128, 4]
    assert ModelConfig.from_dict(PARITY_CASES["scalar_rates_and_flat_yarn"]).compress_rates == {
        CSA: 8,
        HCA: 64,
    }


def test_quantization_config_is_typed_and_folds_top_level_expert_dtype():
    config = ModelConfig.from_dict(
        {
            "num_hidden_layers": 2,
            "expert_dtype": "fp4",
            "quantization_config": {
                "quant_method": "fp8",
                "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128],
            },
        }
    )
    assert config.expert_dtype == "fp4"
    assert config.quantization_config.weight_block_size == (128, 128)
    assert config.quantization_config.scale_fmt == "ue8m0"
    assert ModelConfig.from_dict({}).expert_dtype is None


def test_unknown_keys_are_kept_but_not_passed_to_transformers():
    config = ModelConfig.from_dict(
        {"num_hidden_layers": 2, "architectures": ["X"], "torch_dtype": "bfloat16"}
    )
    assert config.model_extra["architectures"] == ["X"]
    assert config.checkpoint_dtype == "bfloat16"
    assert "architectures" not in config.to_hf_dict()


def test_convenience_properties():
    config = ModelConfig.from_dict(PARITY_CASES["eos_list"])
    assert config.eos_token_ids == [1, 2]
    assert config.num_layers == 1
    assert ModelConfig.from_dict({"eos_token_id": None}).eos_token_ids == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_hidden_layers": 3, "layer_types": [SLIDING, CSA]}, "layer_types has 2 entries"),
        ({"num_hidden_layers": 1, "layer_types": ["full_attention"]}, "layer_types has unknown entries"),
        ({"num_hidden_layers": 1, "mlp_layer_types": ["dense"]}, "mlp_layer_types has unknown entries"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"index_topk": 0}, "index_topk must be positive"),
        ({"head_dim": 32, "qk_rope_head_dim": 64}, "qk_rope_head_dim"),
        ({"o_groups": 7}, "o_groups (7) must divide num_attention_heads"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"model_type": "llama"}, "model_type 'llama' is not supported"),
        ({"compress_ratios": [0, 3], "num_hidden_layers": 2}, "compress_ratios has values [3]"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "needs factor >= 1"),
    ],
)
def test_invalid_config_names_the_field(overrides, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        ModelConfig.from_dict(overrides)


def test_index_topk_is_only_checked_when_a_csa_layer_exists():
    config = ModelConfig.from_dict({"num_hidden_layers": 1, "layer_types": [SLIDING], "index_topk": 0})
    assert config.index_topk == 0


def test_from_dir(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": 2}))
    assert ModelConfig.from_dir(tmp_path).num_hidden_layers == 2


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v4", "max_position_embeddings": 4096, "torch_dtype": "float16"})
    )
    return tmp_path


def test_engine_config_resolves_defaults(model_dir):
    engine = EngineConfig(model=str(model_dir))
    model = registry.load_model_config(engine.model)
    resolved = engine.resolve(model)
    assert resolved.max_model_len == 4096
    assert resolved.max_num_batched_tokens == 8192
    assert engine.max_model_len is None  # resolve returns a copy
    assert EngineConfig(model=str(model_dir), max_model_len=100).resolve(model).max_num_batched_tokens == 8192
    assert EngineConfig(model=str(model_dir), max_num_seqs=9000).resolve(model).max_num_batched_tokens == 9000
    assert engine.torch_dtype(model) == torch.float16
    assert EngineConfig(model=str(model_dir), dtype="float32").torch_dtype(model) == torch.float32
    assert engine.torch_dtype(ModelConfig.from_dict({})) == torch.bfloat16


def test_engine_config_errors_are_actionable(model_dir, tmp_path_factory):
    with pytest.raises(ValidationError, match="not a checkpoint directory"):
        EngineConfig(model=str(tmp_path_factory.mktemp("empty")))
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        EngineConfig(model=str(model_dir), gpu_memory_utilization=1.5)
    with pytest.raises(ValidationError, match="swa_replay"):
        EngineConfig(model=str(model_dir), swa_replay="approximate")
    with pytest.raises(ValidationError, match="must be >= max_num_seqs"):
        EngineConfig(model=str(model_dir), max_num_batched_tokens=16, max_num_seqs=32)
    with pytest.raises(ValidationError, match="max_num_sequences"):
        EngineConfig(model=str(model_dir), max_num_sequences=4)
    engine = EngineConfig(model=str(model_dir), max_model_len=10_000)
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        engine.resolve(registry.load_model_config(engine.model))


def test_engram_options_name_their_field_and_host_tables_need_a_model_with_engram(model_dir):
    with pytest.raises(ValidationError, match="engram_placement"):
        EngineConfig(model=str(model_dir), engram_placement="disk")
    with pytest.raises(ValidationError, match="engram_prefetch"):
        EngineConfig(model=str(model_dir), engram_prefetch="sometimes")
    engine = EngineConfig(model=str(model_dir), engram_placement="host")
    with pytest.raises(ConfigError, match="engram_placement='host': deepseek_v4 has no Engram tables"):
        engine.resolve(registry.load_model_config(engine.model))
    # prefetching is about host tables only: for V4 it is accepted and changes nothing
    engine = EngineConfig(model=str(model_dir), engram_prefetch=False)
    assert engine.resolve(registry.load_model_config(engine.model)).engram_prefetch is False


def test_decoder_trimming_is_off_by_default_and_refused_for_a_model_without_it(model_dir):
    assert EngineConfig(model=str(model_dir)).decoder_trimming is False
    engine = EngineConfig(model=str(model_dir), decoder_trimming=True)
    with pytest.raises(ConfigError, match="decoder_trimming=True: deepseek_v4 has no decoder-side trimming"):
        engine.resolve(registry.load_model_config(engine.model))


# ------------------------------------------------------------------------------------------------ bad config.json


def test_unreadable_config_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": "wide"}))
    with pytest.raises(ConfigError, match=r"(?s)config\.json does not describe a supported DeepSeek-V4 model.*hidden"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"routed_scaling_factor": NaN}', "routed_scaling_factor"),
        ('{"rope_theta": Infinity}', "rope_theta"),
        ('{"swiglu_limit": -Infinity}', "swiglu_limit"),
        ('{"quantization_config": {"weight_block_size": [128, 128], "x": 1}, "hc_eps": NaN}', "hc_eps"),
        (
            '{"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": NaN}}',
            "rope_parameters['compress'] has non-finite values",
        ),
    ],
)
def test_non_finite_config_values_are_config_errors(tmp_path, text, field):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(field)):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vocab_size": 100, "eos_token_id": 100}, "eos_token_id 100 is outside the vocabulary [0, 100)"),
        ({"vocab_size": 100, "eos_token_id": [1, 250]}, "eos_token_id [1, 250] is outside the vocabulary"),
        ({"bos_token_id": -1}, "bos_token_id -1 is outside the vocabulary"),
        ({"vocab_size": 10, "pad_token_id": 10}, "pad_token_id 10 is outside the vocabulary [0, 10)"),
    ],
)
def test_special_token_ids_must_be_in_the_vocabulary(overrides, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        ModelConfig.from_dict(overrides)


def test_values_far_from_the_family_are_warned_about(tmp_path, caplog):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))  # the family's defaults
    with caplog.at_level("WARNING", logger="deepinfer_core.config"):
        ModelConfig.from_dir(tmp_path)
    assert caplog.messages == []
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 3, "sliding_window": 1, "compress_rate_hca": 4, "routed_scaling_factor": 40})
    )
    with caplog.at_level("WARNING", logger="deepinfer_core.config"):
        ModelConfig.from_dir(tmp_path)
    assert len(caplog.messages) == 3
    sliding, scaling, rate = sorted(caplog.messages, key=lambda m: ("sliding" not in m, "scaling" not in m))
    assert str(tmp_path / "config.json") in sliding
    assert "sliding_window is 1, far from the DeepSeek-V4 family's 128 (warned outside [64, 1024])" in sliding
    assert "routed_scaling_factor is 40.0, far from the DeepSeek-V4 family's 1.5" in scaling
    assert "compress_rates['heavily_compressed_attention'] is 4, far from the DeepSeek-V4 family's 128" in rate


def test_index_topk_is_only_warned_about_with_csa_layers():
    config = ModelConfig.from_dict({"num_hidden_layers": 1, "layer_types": [HCA], "index_topk": 1})
    assert config.unusual_values() == []
    config = ModelConfig.from_dict({"num_hidden_layers": 1, "layer_types": [CSA], "index_topk": 1})
    assert config.unusual_values() == [
        "index_topk is 1, far from the DeepSeek-V4 family's 512 (warned outside [64, 4096])"
    ]


def test_v4_declares_every_parallelism_exact_replay_and_the_mtp_drafter():
    capabilities = ModelConfig.from_dict(tiny_config()).capabilities
    assert capabilities.tensor_parallel and capabilities.context_parallel and capabilities.expert_parallel
    assert capabilities.swa_replay_default == "exact" == ModelConfig.swa_replay_default
    assert capabilities.drafters == ("mtp",)
    assert not (capabilities.has_engram or capabilities.can_trim_decoder or capabilities.has_checkpoint_loader)


def test_speculative_config_is_resolved_against_the_drafters_the_model_carries(model_dir):
    v4 = registry.load_model_config(model_dir)
    engine = EngineConfig(model=str(model_dir), speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    resolved = engine.resolve(v4)
    assert isinstance(resolved.speculative_config, SpeculativeConfig)
    assert resolved.speculative_config.num_speculative_tokens == 2
    v41 = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": {}})
    # V4.1's `mtp.*` slot holds DSpark (issue 46): the error says which method reads it
    with pytest.raises(ConfigError, match=r"method 'mtp': the `mtp\.\*` slot of this deepseek_v41 checkpoint holds "
                                          r"DSpark.*use method 'dspark'"):
        engine.resolve(v41)
    ngram = EngineConfig(model=str(model_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert ngram.resolve(v41).speculative_config.method == "ngram"  # drafts from the request's own tokens


def test_config_warnings_are_logged_once_however_often_the_config_is_read(tmp_path, caplog):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "sliding_window": 1}))
    with caplog.at_level("WARNING", logger="deepinfer_core.config"):
        for _ in range(3):  # an engine's build reads it more than once (LLM(...) and serve check options first)
            ModelConfig.from_dir(tmp_path)
    assert len(caplog.messages) == 1 and "sliding_window is 1" in caplog.messages[0]
