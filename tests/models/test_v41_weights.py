"""Loading V4.1's official layout: FP8 32x32 UE8M0 and FP4 dequantised, errors naming tensors, DSpark
skipped and reported, the vision tower loaded when the config has one, differences from the release reported."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core.backends import quant
from deepinfer_core.config import CheckpointError
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.release import release_differences
from deepinfer_core.models.deepseek_v41.weights import load_v41_checkpoint
from tests.models.v41_helpers import make_runner, random_prompt, tiny_checkpoint
from tests.oracle import run_chunked


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def copy_with(directory, target, edit) -> None:
    shutil.copytree(directory, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")


def test_fp8_and_fp4_weights_are_dequantised_with_their_32_blocks(checkpoint):
    directory, weights = checkpoint
    raw = load_file(directory / "model.safetensors")
    w, s = raw["layers.2.attn.wq_b.weight"], raw["layers.2.attn.wq_b.scale"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (8, 1)
    assert torch.equal(weights["layers.2.attn.wq_b.weight"], quant.dequantize_fp8(w, s, (32, 32)))
    w1 = quant.dequantize_fp4(raw["layers.3.ffn.experts.5.w1.weight"], raw["layers.3.ffn.experts.5.w1.scale"])
    assert torch.equal(weights["layers.3.ffn.experts.gate_up_proj"][5, :32], w1)
    assert weights["layers.1.engram.embed.weight"].dtype == torch.uint8  # the table stays in its bytes
    assert len(weights["engram_token_map"]) == 129280 and int(weights["engram_token_map"].max()) == 99091


def test_packed_fp4_experts_give_the_same_logits_as_dequantised_ones(checkpoint):
    directory, weights = checkpoint
    config = V41Config.from_dir(directory)
    packed = load_v41_checkpoint(directory, config, torch.float32, "cpu", keep_fp4=True)
    assert packed["layers.0.ffn.experts.gate_up_proj"].dtype == torch.int8
    prompt = random_prompt(9, seed=2)
    dense = run_chunked(make_runner(directory, weights), [prompt], chunk=9)[0]
    native = run_chunked(make_runner(directory, packed), [prompt], chunk=9)[0]
    assert (dense - native).abs().max().item() < 1e-5


def test_missing_unexpected_misshaped_and_mistyped_tensors_are_named(checkpoint, tmp_path):
    directory, _ = checkpoint
    config = V41Config.from_dir(directory)

    def edit(tensors):
        del tensors["layers.5.attn.indexer.wk.weight"]
        tensors["layers.3.attn.compressor.wkv.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)
        tensors["layers.0.attn_norm.weight"] = torch.zeros(63, dtype=torch.bfloat16)
        tensors["layers.0.ffn.gate.bias"] = tensors["layers.0.ffn.gate.bias"].to(torch.bfloat16)

    copy_with(directory, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as err:
        load_v41_checkpoint(tmp_path / "bad", config, torch.float32, "cpu")
    message = str(err.value)
    assert "missing tensors: ['layers.5.attn.indexer.wk.weight']" in message
    assert "unexpected tensors: ['layers.3.attn.compressor.wkv.weight']" in message  # layer 3 reuses layer 2's
    assert "layers.0.attn_norm.weight has shape [63], expected [64]" in message
    assert "layers.0.ffn.gate.bias is stored as BF16, expected F32" in message


def test_dspark_tensors_are_skipped_and_vision_tensors_loaded_in_their_stored_dtype(checkpoint, caplog):
    directory, _ = checkpoint
    with caplog.at_level(logging.INFO):
        weights = load_v41_checkpoint(directory, V41Config.from_dir(directory), torch.float32, "cpu")
    assert not any(name.startswith("mtp.") for name in weights)
    vision = [n for n in weights if n.startswith(("vision.", "aligner.", "image_"))]
    assert len(vision) == 18 and all(weights[n].dtype == torch.bfloat16 for n in vision)
    raw = load_file(directory / "model.safetensors")
    assert torch.equal(weights["vision.blocks.0.attn.wqkv.weight"], raw["vision.blocks.0.attn.wqkv.weight"])
    assert "skipping 61 DSpark (mtp.*) tensors: the text model does not run them" in caplog.text


def test_vision_tensors_without_a_vision_config_are_skipped_and_reported(checkpoint, tmp_path, caplog):
    directory, _ = checkpoint
    shutil.copytree(directory, tmp_path / "text")
    document = json.loads((tmp_path / "text" / "config.json").read_text())
    del document["vision_config"]
    (tmp_path / "text" / "config.json").write_text(json.dumps(document))
    with caplog.at_level(logging.INFO):
        weights = load_v41_checkpoint(tmp_path / "text", V41Config.from_dir(tmp_path / "text"), torch.float32, "cpu")
    assert not any(name.startswith(("mtp.", "vision.", "aligner.", "image_")) for name in weights)
    assert "skipping 61 DSpark (mtp.*) tensors and 18 vision tensors (its config has no vision tower)" in caplog.text


def test_a_vision_config_without_vision_tensors_names_them_missing(checkpoint, tmp_path):
    directory, _ = checkpoint
    copy_with(directory, tmp_path / "novision",
              lambda tensors: [tensors.pop(n) for n in list(tensors) if n.startswith(("vision.", "aligner.", "image_"))])
    with pytest.raises(CheckpointError, match=r"missing tensors: \['aligner.w1.bias'"):
        load_v41_checkpoint(tmp_path / "novision", V41Config.from_dir(directory), torch.float32, "cpu")


def test_differences_from_the_release_are_listed(checkpoint, tmp_path):
    directory, _ = checkpoint
    lines = release_differences(directory, V41Config.from_dir(directory))
    assert any(line.startswith("config.json SHA-256") for line in lines)
    assert "  num_hidden_layers: 9 (release: 40)" in lines and "  hidden_size: 64 (release: 5120)" in lines
    assert any(line.startswith("tokenizer.json SHA-256") for line in lines)
    assert not any("added token" in line for line in lines)  # V4.1's renamed tokens are all there
    from deepinfer_core.models.tiny import bundled_tokenizer_dir

    shutil.copytree(directory, tmp_path / "v4tok")
    shutil.copyfile(bundled_tokenizer_dir() / "tokenizer.json", tmp_path / "v4tok" / "tokenizer.json")
    lines = release_differences(tmp_path / "v4tok", V41Config.from_dir(directory))
    assert "  added token 128799: '<｜place▁holder▁no▁799｜>' (release: '<｜System｜>')" in lines
    assert sum("added token" in line for line in lines) == 9


def test_a_checkpoint_differing_from_the_release_is_one_warning_line(checkpoint, caplog):
    directory, _ = checkpoint
    with caplog.at_level(logging.WARNING, logger="deepinfer_core.models.deepseek_v41.weights"):
        load_v41_checkpoint(directory, V41Config.from_dir(directory), torch.float32, "cpu")
    (warning,) = [r.getMessage() for r in caplog.records if "differs from the DeepSeek-V4.1-Flash release" in r.getMessage()]
    assert "\n" not in warning and " values (first: config.json SHA-256" in warning
