"""What DeepSeek released for V4.1-Flash: the checkpoint's tensor list (derived from any `V41Config`),
the reference's flat config names, and the release's file hashes, to report a checkpoint that differs.

Sources: research-v41.md §2 (config), §5 (tensors), §9 (tokenizer) and DeepSeek's `inference/model.py`
(§13). The released checkpoint has 96,085 tensors and 510,286,023,000 bytes; `released_tensors` on the
released config reproduces both (tests/models/test_v41_config.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
FP4_GROUP = 32

RELEASE_REVISION = "dba1be0a40aa45a94ad051997016db3960a90277"
CONFIG_SHA256 = ("8be45ce0", "21879")
"""Head and tail of the release `config.json`'s SHA-256 (the full digest is not in our sources)."""
INFERENCE_CONFIG_SHA256 = ("2e84f45c", "a809")
TOKENIZER_SHA256 = "c90dfa01249db1be4245780a052ede752e1361c612ac6d08e2bdada7d599476b"
V41_ADDED_TOKENS = {
    128799: "<｜System｜>", 129264: "<｜deepseek_image｜>",
    **{129265 + k: f"<|place_holder_mm_span_{436 + k:04d}|>" for k in range(6)},
    129279: "<|place_holder_mm_span_0442|>",
}
"""The nine added tokens V4.1 renamed at unchanged ids (research-v41.md §9); 128799 also becomes
normalized and non-special."""

# reference (inference/config.json) name -> config.json text_config name
INFERENCE_NAMES = {
    "dim": "hidden_size", "moe_inter_dim": "moe_intermediate_size", "n_layers": "num_hidden_layers",
    "n_mtp_layers": "num_nextn_predict_layers", "n_heads": "num_attention_heads",
    "n_activated_experts": "num_experts_per_tok", "score_func": "scoring_func", "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim", "norm_eps": "rms_norm_eps", "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids", "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id", "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
_SAME_NAMES = (
    "vocab_size", "n_routed_experts", "n_shared_experts", "swiglu_limit", "q_lora_rank", "head_dim", "o_groups",
    "o_lora_rank", "rope_theta", "compress_rope_theta", "compress_ratios", "index_n_heads", "index_head_dim",
    "index_topk", "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
    "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads",
    "engram_head_dim", "engram_compressed_vocab_size", "image_token_id", "dspark_block_size",
    "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
    "norm_topk_prob",
)
_RUNTIME_ONLY = ("max_batch_size", "max_seq_len", "temperature", "gate_temp")
_VISION = {"vision_n_layers": "num_hidden_layers", "vision_dim": "hidden_size", "vision_n_heads": "num_attention_heads",
           "vision_inter_dim": "intermediate_size", "vision_patch_size": "patch_size",
           "vision_downsample_ratio": "downsample_ratio", "vision_rope_theta": "rope_theta",
           "vision_max_n_token": "max_image_tokens", "vision_min_pixels": "min_pixels",
           "vision_max_wh_ratio": "max_wh_ratio"}


def from_inference_names(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat reference config renamed to `V41Config` fields; an unknown key is a `ConfigError`."""
    from deepinfer_core.config import ConfigError

    out: dict[str, Any] = {}
    vision: dict[str, Any] = {}
    yarn = {k: flat[k] for k in ("rope_factor", "original_seq_len", "beta_fast", "beta_slow") if k in flat}
    for key, value in flat.items():
        if key in INFERENCE_NAMES:
            out[INFERENCE_NAMES[key]] = value
        elif key in _SAME_NAMES:
            out[key] = value
        elif key in _VISION:
            vision[_VISION[key]] = value
        elif key == "dtype":
            out["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                          "expert_dtype": flat.get("expert_dtype")} if value == "fp8" else None
        elif key not in (*yarn, "expert_dtype", *_RUNTIME_ONLY):
            raise ConfigError(f"inference/config.json: unknown key {key!r}")
    if yarn.get("original_seq_len", 0) > 0:
        out["rope_scaling"] = {"rope_type": "yarn", "factor": yarn.get("rope_factor", 40),
                               "original_max_position_embeddings": yarn["original_seq_len"],
                               "beta_fast": yarn.get("beta_fast", 32), "beta_slow": yarn.get("beta_slow", 1)}
    else:
        out["rope_scaling"] = None
    if vision:
        out["vision_config"] = vision
    return out


# ---------------------------------------------------------------------- the tensor list


@dataclass(frozen=True)
class ReleasedTensor:
    """One tensor as the official layout stores it."""

    name: str
    dtype: str
    """Safetensors dtype name."""
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        size = DTYPE_BYTES[self.dtype]
        for dim in self.shape:
            size *= dim
        return size


def released_tensors(config, include_mtp: bool = True, include_vision: bool = True) -> list[ReleasedTensor]:
    """Every tensor of the official layout for `config` (a `V41Config`), in a fixed order."""
    out: list[ReleasedTensor] = []
    h, v = config.hidden_size, config.vocab_size
    out += [ReleasedTensor("embed.weight", "BF16", (v, h)), ReleasedTensor("head.weight", "BF16", (v, h)),
            ReleasedTensor("norm.weight", "BF16", (h,))]
    for layer in range(config.num_hidden_layers):
        out += _block(config, f"layers.{layer}.", config.n_routed_experts)
        out += _attention_extras(config, layer)
        if layer in config.engram_layer_ids:
            out += _engram(config, layer)
    if include_mtp:
        out += _dspark(config)
    if include_vision and config.vision_config is not None and config.vision_config.num_hidden_layers:
        out += _vision(config)
    return out


def _fp8(name: str, rows: int, cols: int, block: tuple[int, int]) -> list[ReleasedTensor]:
    return [ReleasedTensor(f"{name}.weight", "F8_E4M3", (rows, cols)),
            ReleasedTensor(f"{name}.scale", "F8_E8M0", (-(-rows // block[0]), -(-cols // block[1])))]


def _fp4(name: str, rows: int, cols: int) -> list[ReleasedTensor]:
    return [ReleasedTensor(f"{name}.weight", "I8", (rows, cols // 2)),
            ReleasedTensor(f"{name}.scale", "F8_E8M0", (rows, cols // FP4_GROUP))]


def _block(config, prefix: str, num_experts: int) -> list[ReleasedTensor]:
    """The tensors every decoder layer (and DSpark stage) has."""
    h, n, heads, dim = config.hidden_size, config.hc_mult, config.num_attention_heads, config.head_dim
    b, inter = config.fp8_block, config.moe_intermediate_size
    mix = (2 + n) * n
    out = [ReleasedTensor(prefix + "attn_norm.weight", "BF16", (h,)), ReleasedTensor(prefix + "ffn_norm.weight", "BF16", (h,))]
    for site in ("attn", "ffn"):
        out += [ReleasedTensor(f"{prefix}hc_{site}_fn", "F32", (mix, n * h)),
                ReleasedTensor(f"{prefix}hc_{site}_base", "F32", (mix,)),
                ReleasedTensor(f"{prefix}hc_{site}_scale", "F32", (3,))]
    a = prefix + "attn."
    out += [ReleasedTensor(a + "attn_sink", "F32", (heads,)), ReleasedTensor(a + "q_norm.weight", "BF16", (config.q_lora_rank,)),
            ReleasedTensor(a + "kv_norm.weight", "BF16", (dim,))]
    out += _fp8(a + "wq_a", config.q_lora_rank, h, b) + _fp8(a + "wq_b", heads * dim, config.q_lora_rank, b)
    out += _fp8(a + "wkv", dim, h, b)
    out += _fp8(a + "wo_a", config.o_groups * config.o_lora_rank, heads * dim // config.o_groups, b)
    out += _fp8(a + "wo_b", h, config.o_groups * config.o_lora_rank, b)
    f = prefix + "ffn."
    out += [ReleasedTensor(f + "gate.weight", "BF16", (num_experts, h)), ReleasedTensor(f + "gate.bias", "F32", (num_experts,)),
            ReleasedTensor(f + "gate.bias_vl", "F32", (num_experts,))]
    expert = _fp4 if config.expert_dtype == "fp4" else (lambda name, r, c: _fp8(name, r, c, b))
    for e in range(num_experts):
        out += expert(f"{f}experts.{e}.w1", inter, h) + expert(f"{f}experts.{e}.w2", h, inter)
        out += expert(f"{f}experts.{e}.w3", inter, h)
    for w, (rows, cols) in (("w1", (inter, h)), ("w2", (h, inter)), ("w3", (inter, h))):
        out += _fp8(f"{f}shared_experts.{w}", rows, cols, b)
    return out


def _attention_extras(config, layer: int) -> list[ReleasedTensor]:
    """Compressor and index-key tensors of KV sources, the indexer of index sources."""
    a, h, dim, idx = f"layers.{layer}.attn.", config.hidden_size, config.head_dim, config.index_head_dim
    out = []
    if layer in config.kv_source_layer_ids:
        out.append(ReleasedTensor(a + "compressor.wkv.weight", "BF16", (dim, h)))
        if config.compress_ratios[layer] > 1:
            out.append(ReleasedTensor(a + "compressor.wgate.weight", "BF16", (dim, h)))
        out += [ReleasedTensor(a + "compressor.norm.weight", "BF16", (dim,)),
                ReleasedTensor(a + "indexer.wk.weight", "BF16", (idx, dim)),
                ReleasedTensor(a + "indexer.k_norm.weight", "BF16", (idx,))]
    if layer in config.index_source_layer_ids:
        out += _fp8(a + "indexer.wq_b", config.index_n_heads * idx, config.q_lora_rank, config.fp8_block)
        out.append(ReleasedTensor(a + "indexer.weights_proj.weight", "BF16", (config.index_n_heads, h)))
    return out


def _engram(config, layer: int) -> list[ReleasedTensor]:
    e, h = f"layers.{layer}.engram.", config.hidden_size
    rows = config.engram_num_embeddings[config.engram_layer_ids.index(layer)]
    cols = (config.engram_max_ngram_size - 1) * config.engram_n_heads * config.engram_head_dim
    return [ReleasedTensor(e + "embed.weight", "F8_E4M3", (rows, config.engram_head_dim)),
            ReleasedTensor(e + "embed.scale", "F8_E8M0", (rows, config.engram_head_dim // config.fp8_block[1])),
            *_fp8(e + "wkv", (config.hc_mult + 1) * h, cols, config.fp8_block),
            ReleasedTensor(e + "q_weight", "BF16", (config.hc_mult, h)),
            ReleasedTensor(e + "k_weight", "BF16", (config.hc_mult, h))]


def _dspark(config) -> list[ReleasedTensor]:
    h, stages = config.hidden_size, config.num_nextn_predict_layers
    out = []
    for stage in range(stages):
        out += _block(config, f"mtp.{stage}.", config.dspark_n_routed_experts)
    if stages:
        taps = len(config.dspark_target_layer_ids)
        out += _fp8("mtp.0.main_proj", h, taps * h, config.fp8_block)
        out.append(ReleasedTensor("mtp.0.main_norm.weight", "BF16", (h,)))
        last, rank = f"mtp.{stages - 1}.", config.dspark_markov_rank
        out += [ReleasedTensor(last + "norm.weight", "BF16", (h,)),
                ReleasedTensor(last + "markov_head.embed.weight", "BF16", (config.vocab_size, rank)),
                ReleasedTensor(last + "markov_head.head.weight", "BF16", (config.vocab_size, rank)),
                ReleasedTensor(last + "confidence_head.proj.weight", "BF16", (1, h + rank))]
    return out


def _vision(config) -> list[ReleasedTensor]:
    vc, h = config.vision_config, config.hidden_size
    d, p, inter = vc.hidden_size, vc.patch_size, vc.intermediate_size
    out = [ReleasedTensor("vision.patch_embed.proj.weight", "BF16", (d, 3 * p * p)),
           ReleasedTensor("vision.patch_embed.proj.bias", "BF16", (d,))]
    for k in range(vc.num_hidden_layers):
        s = f"vision.blocks.{k}."
        out += [ReleasedTensor(s + "norm1.weight", "BF16", (d,)), ReleasedTensor(s + "norm2.weight", "BF16", (d,)),
                ReleasedTensor(s + "attn.wqkv.weight", "BF16", (3 * d, d)), ReleasedTensor(s + "attn.wqkv.bias", "BF16", (3 * d,)),
                ReleasedTensor(s + "attn.wo.weight", "BF16", (d, d)), ReleasedTensor(s + "attn.wo.bias", "BF16", (d,)),
                ReleasedTensor(s + "mlp.w1.weight", "BF16", (2 * inter, d)), ReleasedTensor(s + "mlp.w2.weight", "BF16", (d, inter))]
    unfolded = d * vc.downsample_ratio**2
    out += [ReleasedTensor("vision.norm.weight", "BF16", (d,)),
            ReleasedTensor("aligner.w1.weight", "BF16", (h, unfolded)), ReleasedTensor("aligner.w1.bias", "BF16", (h,)),
            ReleasedTensor("aligner.w2.weight", "BF16", (h, h)), ReleasedTensor("aligner.w2.bias", "BF16", (h,))]
    out += [ReleasedTensor(name, "BF16", (h,)) for name in ("image_start", "image_newline", "image_end")]
    return out


VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_newline", "image_end")
"""How the vision tower's tensor names begin (the ViT, the aligner, the span's delimiter embeddings)."""


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def is_skipped(name: str, has_vision: bool = False) -> bool:
    """Tensors the model does not run: DSpark (`mtp.*`), and the vision tower's unless `has_vision`
    (its config has a tower: `vision.VisionConfig.of`)."""
    return name.startswith("mtp.") or (not has_vision and is_vision(name))


# ---------------------------------------------------------------------- differences from the release


def release_differences(model_dir: str | Path, config) -> list[str]:
    """One line per way the checkpoint in `model_dir` differs from the release: config.json's hash
    (and then each field that differs from the released values), tokenizer.json's hash (and then each
    of the nine V4.1 added tokens that is not as released). Empty for the release itself."""
    from deepinfer_core.models.deepseek_v41.config import V41Config

    model_dir, lines = Path(model_dir), []
    config_file = model_dir / "config.json"
    if config_file.is_file():
        digest = hashlib.sha256(config_file.read_bytes()).hexdigest()
        if not (digest.startswith(CONFIG_SHA256[0]) and digest.endswith(CONFIG_SHA256[1])):
            lines.append(f"config.json SHA-256 {digest} is not the release's ({CONFIG_SHA256[0]}…{CONFIG_SHA256[1]})")
            released = V41Config().model_dump(exclude={"quantization_config", "vision_config", "transformers_version"})
            mine = config.model_dump(exclude={"quantization_config", "vision_config", "transformers_version"})
            lines += [f"  {key}: {mine[key]!r} (release: {released[key]!r})" for key in released if mine[key] != released[key]]
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        raw = tokenizer_file.read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        if digest != TOKENIZER_SHA256:
            lines.append(f"tokenizer.json SHA-256 {digest} is not the release's ({TOKENIZER_SHA256})")
            added = {t["id"]: t["content"] for t in json.loads(raw).get("added_tokens", [])}
            lines += [f"  added token {i}: {added.get(i)!r} (release: {name!r})"
                      for i, name in V41_ADDED_TOKENS.items() if added.get(i) != name]
    return lines
