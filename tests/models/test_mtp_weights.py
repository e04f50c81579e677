"""Reading the MTP layer's `mtp.*` tensors: every layout, FP8 / FP4 quantised ones dequantised or kept
packed exactly as the layers' are, and a missing or misshaped scale named in a `CheckpointError`."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core.backends import quant
from deepinfer_core.config import CheckpointError, ModelConfig
from deepinfer_core.models.loading.mtp_weights import load_mtp_weights, num_mtp_layers
from deepinfer_core.models.tiny import random_state_dict, tiny_config, write_checkpoint

CONFIG = tiny_config()
WEIGHTS = random_state_dict(CONFIG, seed=5, mtp_layers=1)
MTP = {name.removeprefix("mtp."): tensor for name, tensor in WEIGHTS.items() if name.startswith("mtp.")}
FP8 = ("q_a_proj.weight", "q_b_proj.weight", "kv_proj.weight", "o_a_proj.weight", "o_b_proj.weight",
       "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight",
       "e_proj.weight", "h_proj.weight")  # what `write_checkpoint` stores as FP8 (DeepSeek's choice)
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def written(tmp_path, layout="official", quant_mode="fp8+fp4"):
    model_dir = write_checkpoint(tmp_path, CONFIG, WEIGHTS, layout=layout, quant=quant_mode)
    return model_dir, ModelConfig.from_dir(model_dir)


def dequantised(name: str, tensor: torch.Tensor, quant_mode: str) -> torch.Tensor:
    """What the checkpoint holds for MTP tensor `name` after its round trip through `quant_mode`."""
    ue8m0 = quant_mode == "fp8+fp4"
    if name.endswith(EXPERTS) and ue8m0:
        return quant.dequantize_fp4(*quant.quantize_fp4(tensor))
    if name.endswith(EXPERTS):  # FP8 tiles per expert and per stored part (w1 and w3 apart)
        parts = tensor.chunk(2, dim=1) if name.endswith("gate_up_proj") else (tensor,)
        return torch.cat([dequantised("e_proj.weight", part, quant_mode) for part in parts], dim=1)
    if name.endswith(FP8):
        scale_dtype = torch.float8_e8m0fnu if ue8m0 else torch.float32
        return quant.dequantize_fp8(*quant.quantize_fp8(tensor, (128, 128), scale_dtype), (128, 128))
    return tensor


@pytest.mark.parametrize("layout", ["hf", "official", "transformers"])
def test_mtp_tensors_read_in_every_layout(tmp_path, layout):
    model_dir, config = written(tmp_path, layout, None)
    assert config.num_nextn_predict_layers == 1
    loaded = load_mtp_weights(model_dir, config)
    assert loaded.keys() == MTP.keys()
    assert all(torch.equal(loaded[name], MTP[name]) for name in MTP)


@pytest.mark.parametrize("layout", ["official", "transformers"])
@pytest.mark.parametrize("quant_mode", ["fp8", "fp8+fp4"])
def test_quantised_mtp_tensors_load_dequantised(tmp_path, layout, quant_mode):
    model_dir, config = written(tmp_path, layout, quant_mode)
    on_disk = load_file(next(model_dir.glob("*.safetensors")))
    assert any(t.dtype == torch.float8_e4m3fn for n, t in on_disk.items() if "mtp." in n)
    assert (quant_mode == "fp8+fp4") == any(t.dtype == torch.int8 for n, t in on_disk.items() if "mtp." in n)
    loaded = load_mtp_weights(model_dir, config)
    assert loaded.keys() == MTP.keys()
    for name, tensor in MTP.items():
        expected = dequantised(name, tensor, quant_mode)
        assert loaded[name].dtype == tensor.dtype
        torch.testing.assert_close(loaded[name], expected, rtol=0, atol=0, msg=name)
        if name.endswith(FP8 + EXPERTS):  # really quantised: the round trip moved it
            assert not torch.equal(expected, tensor), name


def test_kept_mtp_tensors_are_the_bytes_written(tmp_path):
    model_dir, config = written(tmp_path)
    on_disk = load_file(next(model_dir.glob("*.safetensors")))
    kept = load_mtp_weights(model_dir, config, keep_fp4=True, keep_fp8=True)
    assert kept["0.e_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(kept["0.e_proj.weight"].view(torch.uint8), on_disk["mtp.0.e_proj.weight"].view(torch.uint8))
    assert torch.equal(kept["0.self_attn.q_a_proj.weight_scale"], on_disk["mtp.0.attn.wq_a.scale"].float())
    w1 = torch.stack([on_disk[f"mtp.0.ffn.experts.{e}.w1.weight"] for e in range(CONFIG["n_routed_experts"])])
    w3 = torch.stack([on_disk[f"mtp.0.ffn.experts.{e}.w3.weight"] for e in range(CONFIG["n_routed_experts"])])
    assert torch.equal(kept["0.mlp.experts.gate_up_proj"], torch.cat([w1, w3], dim=1))
    assert kept["0.mlp.experts.down_proj_scale"].dtype == quant.FP4_SCALE_DTYPE
    fp8_names = {name for name in MTP if name.endswith(FP8)}
    assert {name.removesuffix("_scale") for name in kept if name.endswith(".weight_scale")} == fp8_names
    assert all(torch.equal(kept[name], MTP[name]) for name in MTP if not name.endswith(FP8 + EXPERTS))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda tensors: tensors.pop("mtp.0.attn.wq_b.scale"), r"missing tensors: mtp\.0\.attn\.wq_b\.scale"),
    (lambda tensors: tensors.update({"mtp.0.h_proj.scale": torch.ones(2, 3)}),
     r"misshaped tensors: mtp\.0\.h_proj\.scale has shape \[2, 3\], expected \[1, 1\]"),
    (lambda tensors: tensors.update({"mtp.0.ffn.experts.3.w2.scale": torch.ones(64, 2)}),
     r"misshaped tensors: mtp\.0\.ffn\.experts\.3\.w2\.scale has shape \[64, 2\], expected \[64, 1\]"),
])
def test_a_missing_or_misshaped_mtp_scale_is_named(tmp_path, edit, message):
    model_dir, config = written(tmp_path)
    path = next(model_dir.glob("*.safetensors"))
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    for keep in (False, True):
        with pytest.raises(CheckpointError, match=message):
            load_mtp_weights(model_dir, config, keep_fp4=keep, keep_fp8=keep)


def test_an_unexpected_mtp_tensor_is_named_and_the_model_loader_ignores_mtp(tmp_path):
    from deepinfer_core.models.loading.weights import load_weights

    model_dir, config = written(tmp_path)
    path = next(model_dir.glob("*.safetensors"))
    save_file(load_file(path) | {"mtp.0.attn.extra": torch.ones(2)}, path)
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(for the 'official' layout\): mtp\.0\.attn\.extra"):
        load_mtp_weights(model_dir, config)
    assert not any(name.startswith("mtp.") for name in load_weights(model_dir, config))


def test_num_mtp_layers():
    assert num_mtp_layers(["layers.0.attn.wq_a.weight"]) == 0
    assert num_mtp_layers(["mtp.0.enorm.weight", "model.mtp.1.attn.wq_a.weight"]) == 2
