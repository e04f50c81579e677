import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from deepinfer_core.backends import quant
from deepinfer_core.config import ModelConfig
from deepinfer_core.models.loading.checkpoint_layout import meta_model, tensor_schema
from deepinfer_core.models.loading.weights import CheckpointError, load_model, load_weights
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


def test_progress_bar_counts_bytes_and_tensors(tmp_path, weights, capsys):
    write_checkpoint(tmp_path, CONFIG, weights)
    loaded = load(tmp_path, progress=True)
    final = re.split(r"[\r\n]", capsys.readouterr().err.strip())[-1]
    checkpoint_mib = sum(path.stat().st_size for path in tmp_path.glob("*.safetensors")) / 2**20
    match = re.search(r"Loading weights: 100%.*?([\d.]+)M/([\d.]+)M.*?(\d+)/(\d+) tensors", final)
    assert match, final
    read_mib, total_mib, done, planned = float(match[1]), float(match[2]), int(match[3]), int(match[4])
    assert read_mib == total_mib and abs(total_mib - checkpoint_mib) < 0.05 * checkpoint_mib + 0.1
    assert done == planned == len(loaded)


# ---------------------------------------------------------------------- non-finite values (issue 14 item 8)


def _rows_of(weights, name, value, row=3):
    """`weights` with row `row` of `name` (an element, for a vector) set to `value`."""
    broken = {n: t.clone() for n, t in weights.items()}
    broken[name][row] = value
    return broken


@pytest.mark.parametrize(
    "name",
    ["lm_head.weight", "model.layers.1.self_attn.q_b_proj.weight", "model.norm.weight", "model.embed_tokens.weight"],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight_is_named(tmp_path, weights, name, value):
    write_checkpoint(tmp_path, CONFIG, _rows_of(weights, name, value), layout="official")
    with pytest.raises(CheckpointError, match=rf"NaN or Inf.*{re.escape(name)} \(torch.float32\)") as error:
        load(tmp_path)
    assert str(tmp_path) in str(error.value)
    assert str(error.value).count("torch.float32") == 1  # only the broken tensor


def test_non_finite_fp8_value_and_scale_are_named(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, layout="official", quant="fp8")

    def edit(tensors):
        tensors["layers.0.attn.wq_a.weight"][0, 0] = float("nan")  # e4m3fn's NaN code
        tensors["layers.2.attn.wo_b.scale"][0, 0] = float("inf")

    _edit(tmp_path, edit)
    with pytest.raises(CheckpointError, match="q_a_proj.weight.*o_b_proj.weight"):
        load(tmp_path)


def test_overflow_into_the_load_dtype_is_named(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, _rows_of(weights, "lm_head.weight", 1e5), dtype=torch.bfloat16)
    assert load(tmp_path, dtype=torch.bfloat16)["lm_head.weight"].isfinite().all()
    with pytest.raises(CheckpointError, match=r"lm_head.weight \(torch.float16\)"):
        load(tmp_path, dtype=torch.float16)  # 1e5 is past float16's largest value


def test_huge_finite_weights_are_not_reported(tmp_path, weights):
    # their float32 sum overflows; the element-wise check then clears them
    huge = _rows_of(weights, "model.layers.0.self_attn.kv_proj.weight", 3e38)
    write_checkpoint(tmp_path, CONFIG, huge)
    assert load(tmp_path)["model.layers.0.self_attn.kv_proj.weight"].max() == 3e38


# ---------------------------------------------------------------------- header dtypes (issue 14 item 9)


def test_tensor_stored_in_another_float_dtype_is_named(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, layout="official", dtype=torch.bfloat16)
    _edit(tmp_path, lambda t: t.update({"layers.1.attn.wq_b.weight": t["layers.1.attn.wq_b.weight"].half()}))
    with pytest.raises(
        CheckpointError,
        match=r"wrong dtype: layers\.1\.attn\.wq_b\.weight is stored as F16, expected BF16 or F32 "
        r"\(config\.json's dtype 'bfloat16'\)$",
    ):
        load(tmp_path)


def test_without_a_declared_dtype_the_embedding_sets_the_float_dtype(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, dtype=torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["torch_dtype"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    _edit(tmp_path, lambda t: t.update({"lm_head.weight": t["lm_head.weight"].half()}))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight is stored as F16, expected BF16 or F32 \(the dtype "
                       r"of model\.embed_tokens\.weight\)"):
        load(tmp_path)


def test_float32_storage_of_any_float_tensor_loads(tmp_path, weights):
    # transformers' save_pretrained keeps norms, mHC and sinks in F32 inside a bf16 checkpoint
    write_checkpoint(tmp_path, CONFIG, weights, dtype=torch.bfloat16)
    _edit(tmp_path, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].float()}))
    assert load(tmp_path)["model.norm.weight"].dtype == torch.float32


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update({"model.norm.weight": quant.quantize_fp8(t["model.norm.weight"].view(1, -1), (128, 128))[0],
                             "model.norm.weight_scale_inv": torch.ones(1, 1)}),
         r"model\.norm\.weight is stored as F8_E4M3, expected F32"),
        (lambda t: t.update({"model.layers.0.mlp.gate.tid2eid": t["model.layers.0.mlp.gate.tid2eid"].float()}),
         r"tid2eid is stored as F32, expected I8 or I16"),
        (lambda t: t.update({"model.layers.0.self_attn.kv_proj.weight_scale_inv":
                             t["model.layers.0.self_attn.kv_proj.weight_scale_inv"].half()}),
         r"kv_proj\.weight_scale_inv is stored as F16, expected F32 or BF16 or F8_E8M0"),
    ],
    ids=["fp8_norm", "float_hash_table", "f16_scale"],
)
def test_storage_the_layout_does_not_allow_is_named(tmp_path, weights, edit, message):
    write_checkpoint(tmp_path, CONFIG, weights, quant="fp8")
    _edit(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load(tmp_path)


def test_packed_fp4_is_only_for_routed_experts(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, layout="official", quant="fp8+fp4")

    def edit(tensors):
        weight = tensors.pop("layers.0.ffn.shared_experts.w2.weight").float()
        scale = tensors.pop("layers.0.ffn.shared_experts.w2.scale").float()
        packed, fp4_scale = quant.quantize_fp4(quant.dequantize_fp8(weight.to(quant.FP8_DTYPE), scale, (128, 128)))
        tensors["layers.0.ffn.shared_experts.w2.weight"] = packed
        tensors["layers.0.ffn.shared_experts.w2.scale"] = fp4_scale

    _edit(tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"shared_experts\.w2\.weight is stored as I8, expected F32"):
        load(tmp_path)


# ---------------------------------------------------------------------- unreadable files (issue 14 item 10)


def test_garbage_index_names_the_file(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, shards=2)
    (tmp_path / "model.safetensors.index.json").write_bytes(b"\xff\xfe{garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json is not a readable JSON index"):
        load(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": 3}}')
    with pytest.raises(CheckpointError, match="has no 'weight_map' object"):
        load(tmp_path)


def test_weights_path_that_is_a_directory_is_named(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a file"):
        load(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_unreadable_safetensors_file_is_named(tmp_path, weights, damage):
    write_checkpoint(tmp_path, CONFIG, weights, shards=2)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07garbage" * 64)
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors is not a readable safetensors file"):
        load(tmp_path)


def test_index_naming_a_shard_that_lacks_the_tensor(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"files that do not hold them: \['lm_head\.weight'\]"):
        load(tmp_path)


def test_missing_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="is not a checkpoint directory"):
        load_weights(tmp_path / "absent", ModelConfig.from_dict(CONFIG))


# ---------------------------------------------------------------------- loading into a model (the runner's path)


def test_load_model_gives_every_tensor_its_modules_dtype(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights, layout="official")
    config = ModelConfig.from_dir(tmp_path)
    model = load_model(meta_model(config, torch.bfloat16), config, tmp_path, "cpu")
    declared = tensor_schema(meta_model(config, torch.bfloat16))
    loaded = model.state_dict()
    assert {name: t.dtype for name, t in loaded.items()} == {name: spec.dtype for name, spec in declared.items()}
    assert all(t.device.type == "cpu" for t in loaded.values())
    assert torch.equal(loaded["model.norm.weight"], weights["model.norm.weight"])  # kept float32, exact
    assert torch.equal(loaded["lm_head.weight"], weights["lm_head.weight"].bfloat16())


def test_load_model_from_given_weights_checks_and_casts_them(weights):
    config = ModelConfig.from_dict(CONFIG)
    model = load_model(meta_model(config, torch.bfloat16), config, None, "cpu", weights=weights)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.model.norm.weight.dtype == torch.float32
    broken = dict(weights) | {"lm_head.weight": torch.full_like(weights["lm_head.weight"], float("nan"))}
    with pytest.raises(CheckpointError, match=r"given weights: .*lm_head\.weight"):
        load_model(meta_model(config), config, None, "cpu", weights=broken)
    partial = {n: t for n, t in weights.items() if n != "model.norm.weight"} | {"extra": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.norm\.weight; unexpected tensors: extra"):
        load_model(meta_model(config), config, None, "cpu", weights=partial)


def test_load_model_refuses_a_model_of_another_config(tmp_path, weights):
    write_checkpoint(tmp_path, CONFIG, weights)
    config = ModelConfig.from_dir(tmp_path)
    other = meta_model(ModelConfig.from_dict(tiny_config("sliding_only")))
    with pytest.raises(ValueError, match="the model's tensors differ"):
        load_model(other, config, tmp_path, "cpu")


@pytest.mark.parametrize("layout", ["hf", "official"])
@pytest.mark.parametrize("quant_mode", [None, "fp8+fp4"])
def test_an_expert_parallel_rank_reads_only_its_experts(tmp_path, weights, layout, quant_mode):
    write_checkpoint(tmp_path, CONFIG, weights, layout=layout, quant=quant_mode)
    keep_fp4 = quant_mode is not None
    whole = load(tmp_path, keep_fp4=keep_fp4)
    mine = {0: [4, 5, 6, 7], 1: [0, 1, 2, 0], 2: [7, 3, 3, 1]}  # per layer, one expert a local slot (replicas repeat)
    local = load(tmp_path, keep_fp4=keep_fp4, local_experts=mine.__getitem__)
    assert local.keys() == whole.keys()
    for name, tensor in whole.items():
        if ".mlp.experts." in name:
            layer = int(name.split(".")[2])
            assert torch.equal(local[name].view(torch.uint8), tensor[mine[layer]].view(torch.uint8)), name
        else:
            assert torch.equal(local[name], tensor), name
