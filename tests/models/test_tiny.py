"""The tiny checkpoints: configs, random weights, the writer and the embedded tiny model."""

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from deepinfer_core.config import CSA, HCA, SLIDING, ModelConfig
from deepinfer_core.models import tiny
from deepinfer_core.models.loading.weights import expected_tensors, load_weights
from deepinfer_core.models.tiny import (
    PRESETS,
    embedded_tiny_model_dir,
    random_state_dict,
    tiny_config,
    write_checkpoint,
)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_are_valid_configs(preset):
    config = ModelConfig.from_dict(tiny_config(preset))
    assert config.num_layers == len(config.layer_types)


def test_default_preset_mixes_every_layer_kind_with_small_windows():
    config = ModelConfig.from_dict(tiny_config())
    assert config.layer_types == [SLIDING, CSA, HCA]
    assert set(config.mlp_layer_types) == {"hash_moe", "moe"}
    assert config.sliding_window == 8 and config.compress_rates == {CSA: 4, HCA: 16}
    assert config.qk_rope_head_dim == 16 and config.rope_parameters["compress"]["rope_type"] == "yarn"


def test_overrides_win_and_are_validated():
    assert tiny_config(hc_mult=3)["hc_mult"] == 3
    with pytest.raises(ValueError, match="o_groups"):
        tiny_config(o_groups=3)
    with pytest.raises(ValueError, match="unknown preset"):
        tiny_config("huge")


def test_random_weights_are_deterministic_and_exercise_every_parameter():
    config = ModelConfig.from_dict(tiny_config())
    first, again, other = (
        random_state_dict(config, 0),
        random_state_dict(config, 0),
        random_state_dict(config, 1),
    )
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])
    assert {name: tuple(t.shape) for name, t in first.items()} == expected_tensors(config)
    table = first["model.layers.0.mlp.gate.tid2eid"]
    assert table.dtype == torch.int64 and 0 <= table.min() and table.max() < config.n_routed_experts
    assert (table[:, 0] != table[:, 1]).all()  # distinct experts per token
    for name in ("self_attn.sinks", "self_attn.compressor.position_bias", "mlp.gate.e_score_correction_bias"):
        assert first[f"model.layers.1.{name}"].abs().min() > 0, name
    assert abs(first["model.layers.0.input_layernorm.weight"].mean() - 1) < 0.1
    assert not torch.equal(first["model.layers.0.attn_hc.scale"], torch.ones(3))


def test_write_checkpoint_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="quant must be"):
        write_checkpoint(tmp_path, tiny_config(), quant="int4")
    with pytest.raises(ValueError, match="state_dict names differ"):
        write_checkpoint(tmp_path, tiny_config(), state_dict={"x": torch.zeros(1)})


def test_write_checkpoint_records_quantisation_in_config(tmp_path):
    write_checkpoint(tmp_path, tiny_config(), layout="official", quant="fp8+fp4")
    config = ModelConfig.from_dir(tmp_path)
    assert config.expert_dtype == "fp4" and config.quantization_config.scale_fmt == "ue8m0"
    assert config.quantization_config.weight_block_size == (128, 128)


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_embedded_tiny_model_has_the_real_tokenizer(cache_home):
    directory = embedded_tiny_model_dir()
    assert directory.parent == cache_home / "deepinfer"
    config = ModelConfig.from_dir(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert config.vocab_size == 129280 >= tokenizer.get_vocab_size()
    assert tokenizer.id_to_token(config.bos_token_id) == "<｜begin▁of▁sentence｜>"
    assert tokenizer.id_to_token(config.eos_token_ids[0]) == "<｜end▁of▁sentence｜>"
    assert config.layer_types == [SLIDING, CSA, HCA]
    size = sum(path.stat().st_size for path in directory.iterdir())
    assert size < 100 * 2**20
    with safe_open(directory / "model.safetensors", "pt") as handle:
        assert handle.get_slice("lm_head.weight").get_dtype() == "BF16"
    weights = load_weights(directory, config)
    assert weights["lm_head.weight"].shape == (129280, config.hidden_size)


def test_embedded_tiny_model_is_built_once(cache_home, monkeypatch):
    first = embedded_tiny_model_dir()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(tiny, "write_checkpoint", lambda *a, **k: pytest.fail("rebuilt"))
    assert embedded_tiny_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging directory left


def test_embedded_tiny_model_key_changes_with_version(cache_home, monkeypatch):
    first = embedded_tiny_model_dir()
    monkeypatch.setattr(tiny, "TINY_MODEL_VERSION", "test-other")
    second = embedded_tiny_model_dir()
    assert first != second and json.loads((second / "config.json").read_text())["vocab_size"] == 129280


def test_only_tests_import_the_testing_package():
    # serve and the example build the embedded model from models/tiny.py, not from deepinfer_core.testing
    root = Path(__file__).resolve().parents[2]
    sources = [*(root / "deepinfer_core").rglob("*.py"), *(root / "examples").rglob("*.py")]
    offenders = []
    for path in sources:
        if "testing" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            if any(name == "deepinfer_core.testing" or name.startswith("deepinfer_core.testing.") for name in names):
                offenders.append(str(path.relative_to(root)))
    assert offenders == []
