import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from deepinfer_core.config import ModelConfig
from deepinfer_core.models import quant
from deepinfer_core.models.weights import CheckpointError, load_weights
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config, write_checkpoint

transformers.logging.set_verbosity_error()

CONFIG = tiny_config()


@pytest.fixture(scope="module")
def weights():
    return random_state_dict(CONFIG, seed=3)


def load(directory, **kwargs):
    return load_weights(directory, ModelConfig.from_dir(directory), **kwargs)


def assert_same(loaded, expected):
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("layout", ["hf", "official", "transformers"])
def test_every_layout_loads_the_same_tensors(tmp_path, weights, layout):
    write_checkpoint(tmp_path, CONFIG, weights, layout=layout)
    assert_same(load(tmp_path), weights)


def test_sharded_checkpoint_with_index(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, layout="official", shards=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert not (tmp_path / "model.safetensors").exists()
    assert_same(load(tmp_path), weights)


def test_transformers_save_pretrained_output_loads(tmp_path, weights):
    config = ModelConfig.from_dict(CONFIG)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**config.to_hf_dict()))
    model.load_state_dict(weights, strict=True)
    model.save_pretrained(tmp_path)
    assert_same(load_weights(tmp_path, config), weights)


def test_loaded_weights_fit_transformers_model_strictly(tmp_path):
    config_dict = tiny_config("deep")
    write_checkpoint(tmp_path, config_dict, layout="official", seed=5)
    config = ModelConfig.from_dir(tmp_path)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**config.to_hf_dict()))
    loaded = load_weights(tmp_path, config)
    model.load_state_dict(loaded, strict=True)
    assert torch.equal(model.model.layers[0].mlp.gate.tid2eid, loaded["model.layers.0.mlp.gate.tid2eid"])


def _raw_scales(directory):
    """Internal-name -> block/group scale tensor, read back from an hf-layout quantised checkpoint."""
    tensors = load_file(directory / "model.safetensors")
    return {
        name.removesuffix("_scale_inv"): tensor for name, tensor in tensors.items() if "_scale_inv" in name
    }


@pytest.mark.parametrize("quant_mode", ["fp8", "fp8+fp4"])
def test_quantised_checkpoints_load_within_format_rounding(tmp_path, weights, quant_mode):
    write_checkpoint(tmp_path, CONFIG, weights, layout="hf", quant=quant_mode)
    loaded = load(tmp_path)
    scales = _raw_scales(tmp_path)
    assert "model.layers.0.self_attn.q_a_proj.weight" in scales
    assert "model.layers.0.self_attn.compressor.kv_proj.weight" not in scales  # shipped unquantised
    for name, tensor in weights.items():
        if name not in scales:
            assert torch.equal(loaded[name], tensor), name
            continue
        error = (loaded[name] - tensor).abs()
        scale = scales[name]
        if quant_mode == "fp8+fp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert scale.dtype == torch.float8_e8m0fnu
            bound = quant.fp4_rounding_bound(tensor, scale)
        else:
            bound = quant.fp8_rounding_bound(tensor, scale, (128, 128))
        assert (error <= bound).all(), name
        assert error.max() > 0, name


@pytest.mark.parametrize("quant_mode", ["fp8", "fp8+fp4"])
def test_quantised_official_layout_matches_quantised_hf_layout(tmp_path, weights, quant_mode):
    # experts are quantised per expert in the official layout and as one 3D tensor in the hf one; with
    # 64-row halves and 128-row blocks the FP8 tiles differ, so compare everything except experts exactly
    write_checkpoint(tmp_path / "official", CONFIG, weights, layout="official", quant=quant_mode)
    write_checkpoint(tmp_path / "hf", CONFIG, weights, layout="hf", quant=quant_mode)
    official, hf = load(tmp_path / "official"), load(tmp_path / "hf")
    official_files = load_file(tmp_path / "official" / "model.safetensors")
    assert official_files["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert "layers.0.attn.wq_a.scale" in official_files
    for name in weights:
        if "mlp.experts" not in name:
            assert torch.equal(official[name], hf[name]), name
    if quant_mode == "fp8+fp4":  # FP4 groups run along the input dim only, so they are the same
        assert official_files["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
        assert torch.equal(
            official["model.layers.0.mlp.experts.gate_up_proj"], hf["model.layers.0.mlp.experts.gate_up_proj"]
        )


def test_scale_spelled_weight_scale_inv_in_official_layout(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, layout="official", quant="fp8")
    tensors = load_file(tmp_path / "model.safetensors")
    expected = load(tmp_path)
    tensors["layers.0.attn.wq_a.weight_scale_inv"] = tensors.pop("layers.0.attn.wq_a.scale")
    save_file(tensors, tmp_path / "model.safetensors")
    assert torch.equal(
        load(tmp_path)["model.layers.0.self_attn.q_a_proj.weight"],
        expected["model.layers.0.self_attn.q_a_proj.weight"],
    )


def test_bfloat16_load_keeps_fp32_tensors_and_int64_tables(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, dtype=torch.bfloat16)
    loaded = load(tmp_path, dtype=torch.bfloat16)
    assert loaded["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    assert loaded["model.layers.0.attn_hc.fn"].dtype == torch.float32
    assert loaded["model.norm.weight"].dtype == torch.float32
    assert loaded["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64
    assert torch.equal(loaded["model.layers.0.mlp.gate.tid2eid"], weights["model.layers.0.mlp.gate.tid2eid"])


def _edit(directory, edit):
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


def test_missing_tensor_is_named(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, layout="official")
    _edit(tmp_path, lambda t: t.pop("layers.1.attn.indexer.wq_b.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.1\.attn\.indexer\.wq_b\.weight"):
        load(tmp_path)


def test_missing_scale_is_named(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, layout="official", quant="fp8")
    _edit(tmp_path, lambda t: t.pop("layers.2.attn.wo_b.scale"))
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.2\.attn\.wo_b\.scale"):
        load(tmp_path)


def test_unexpected_tensor_is_named_with_layout(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, layout="official")
    _edit(
        tmp_path,
        lambda t: t.update(
            {"layers.0.attn.extra.weight": torch.zeros(2), "mtp.0.norm.weight": torch.ones(2)}
        ),
    )
    with pytest.raises(
        CheckpointError,
        match=r"unexpected tensors \(for the 'official' layout\): layers\.0\.attn\.extra\.weight$",
    ):
        load(tmp_path)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights)
    _edit(
        tmp_path,
        lambda t: t.update({"model.layers.2.self_attn.compressor.position_bias": torch.zeros(4, 64)}),
    )
    with pytest.raises(
        CheckpointError,
        match=r"model\.layers\.2\.self_attn\.compressor\.position_bias has shape \[4, 64\], expected \[16, 64\]",
    ):
        load(tmp_path)


def test_misshaped_fp4_scale_is_named(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, layout="official", quant="fp8+fp4")
    _edit(
        tmp_path,
        lambda t: t.update({"layers.0.ffn.experts.3.w2.scale": t["layers.0.ffn.experts.3.w2.scale"][:, :0]}),
    )
    with pytest.raises(
        CheckpointError,
        match=r"layers\.0\.ffn\.experts\.3\.w2\.scale has shape \[64, 0\], expected \[64, 1\]",
    ):
        load(tmp_path)


def test_packed_experts_need_fp4_expert_dtype(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, layout="official", quant="fp8+fp4")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["expert_dtype"] = "fp8"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="expert_dtype is not 'fp4'"):
        load(tmp_path)


def test_config_mismatch_reports_every_problem_at_once(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights)
    bigger = ModelConfig.from_dict(tiny_config(vocab_size=600))
    with pytest.raises(CheckpointError, match="misshaped") as error:
        load_weights(tmp_path, bigger)
    assert "model.embed_tokens.weight" in str(error.value) and "lm_head.weight" in str(error.value)


def test_out_of_range_hash_table_is_rejected(tmp_path, weights):
    broken = dict(weights)
    broken["model.layers.0.mlp.gate.tid2eid"] = weights["model.layers.0.mlp.gate.tid2eid"].clone()
    broken["model.layers.0.mlp.gate.tid2eid"][5, 0] = 8
    write_checkpoint(tmp_path, CONFIG, broken)
    with pytest.raises(CheckpointError, match=r"tid2eid holds expert ids outside \[0, 8\)"):
        load(tmp_path)


def test_empty_directory_and_broken_index(tmp_path, weights):
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_weights(tmp_path, ModelConfig.from_dict(CONFIG))
    write_checkpoint(tmp_path, CONFIG, weights, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard files that do not exist"):
        load(tmp_path)


def test_progress_bar_can_be_forced(tmp_path, weights, capsys):
    write_checkpoint(tmp_path, CONFIG, weights)
    load(tmp_path, progress=True)
    assert "Loading weights" in capsys.readouterr().err
    load(tmp_path, progress=False)
    assert "Loading weights" not in capsys.readouterr().err
