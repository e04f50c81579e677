"""The model registry: families by model_type / architectures, plugins' families first."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer_core import hookimpl
from deepinfer_core.config import ConfigError, ModelConfig
from deepinfer_core.models import registry
from deepinfer_core.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer_core.models.interface import CausalLM
from deepinfer_core.models.tiny import tiny_config


def test_v4_is_found_by_model_type_or_by_architecture():
    assert registry.find_model({"model_type": "deepseek_v4"}).model_type == "deepseek_v4"
    assert registry.find_model({"architectures": ["DeepseekV4ForCausalLM"]}).model_type == "deepseek_v4"
    assert registry.import_object(registry.find_model({}).model_class) is DeepseekV4ForCausalLM
    config = ModelConfig.from_dict(tiny_config())
    cls = registry.model_class(config)
    with torch.device("meta"):
        model = cls(config, cls.layer_plan(config, torch.float32), torch.float32)
    assert isinstance(model, CausalLM) and len(model.plans) == config.num_hidden_layers


def test_an_unknown_family_is_an_error_naming_the_known_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"'llama'.*known: deepseek_v4 \(DeepseekV4ForCausalLM\).*register_models"):
        registry.load_model_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        registry.load_model_config(tmp_path)


class _MyModels:
    @hookimpl
    def register_models(self, register):
        register("my_family", ["MyForCausalLM"], "deepinfer_core.models.deepseek_v4.model:DeepseekV4ForCausalLM")
        register("deepseek_v4", ["DeepseekV4ForCausalLM"], "json:JSONDecoder")  # replaces the built-in


def test_a_plugin_adds_families_and_is_asked_before_the_built_ins(isolated_plugin_manager):
    isolated_plugin_manager.register(_MyModels(), name="mine")
    assert registry.find_model({"architectures": ["MyForCausalLM"]}).model_type == "my_family"
    assert registry.find_model({"model_type": "deepseek_v4"}).model_class == "json:JSONDecoder"
    with pytest.raises(ConfigError, match="cannot import 'nowhere:Model'"):
        registry.import_object("nowhere:Model")


def test_both_families_satisfy_the_model_contract_and_expose_their_capabilities():
    from deepinfer_core.models.deepseek_v41.config import V41Config
    from deepinfer_core.models.v41_tiny import tiny_v41_config

    for config in (ModelConfig.from_dict(tiny_config()), V41Config.from_dict(tiny_v41_config())):
        cls = registry.model_class(config)
        with torch.device("meta"):
            model = cls(config, cls.layer_plan(config, torch.float32), torch.float32)
        assert isinstance(model, CausalLM) and model.capabilities == config.capabilities
        assert model.trim_layer is None and model.final_streams is None and not model.keeps_final_streams
        assert cls.host_weight_names({"a"}, "device") == set()
        assert hasattr(cls, "load_checkpoint") == config.capabilities.has_checkpoint_loader
