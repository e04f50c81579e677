"""The names and shapes of DeepSeek-V4 tensors, and the one table between the two checkpoint layouts.

Internal tensor names are transformers' `save_pretrained` names for `DeepseekV4ForCausalLM`;
`expected_tensors(config)` is the single source of truth for them and their shapes. On disk:

- "hf": what transformers writes; names are the internal names.
- "official": DeepSeek's release layout (`embed.weight`, `layers.N.attn.wq_a.weight`,
  `layers.N.ffn.experts.E.w1.weight`, ...), mapped by `_TOP_LEVEL` and `_PER_LAYER` below. Per-expert
  `w1` (gate) and `w3` (up) merge into `experts.gate_up_proj[E, 2I, H]` = cat(w1, w3) per expert, and
  `w2` stacks into `experts.down_proj[E, H, I]`. Multi-token-prediction tensors (`mtp.*`) are not used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from deepinfer_core.config import CSA, SLIDING, ModelConfig

IGNORED_PREFIXES = ("mtp.", "model.mtp.")
# Kept in float32 whatever the requested dtype, as transformers' `_keep_in_fp32_modules_strict` does.
_FP32_PATTERN = re.compile(
    r"(attn_hc|ffn_hc|hc_head)\.|\.sinks$|position_bias$|e_score_correction_bias$"
    r"|(q_a_norm|kv_norm|input_layernorm|post_attention_layernorm)\.weight$|^model\.norm\.weight$"
)


class CheckpointError(ValueError):
    """The checkpoint does not match the model config (missing, unexpected or misshaped tensors)."""


# ---------------------------------------------------------------------- expected names and shapes


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, internal name -> shape (transformers' `state_dict()` order)."""
    tensors: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size)
    }
    for layer_idx in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer_idx}."
        tensors |= {prefix + k: v for k, v in _attention_tensors(config, layer_idx).items()}
        tensors |= {prefix + k: v for k, v in _mlp_tensors(config, layer_idx).items()}
        hidden = config.hidden_size
        tensors[prefix + "input_layernorm.weight"] = (hidden,)
        tensors[prefix + "post_attention_layernorm.weight"] = (hidden,)
        num_mix = (2 + config.hc_mult) * config.hc_mult
        for hc in ("attn_hc", "ffn_hc"):
            tensors[f"{prefix}{hc}.fn"] = (num_mix, config.hc_mult * hidden)
            tensors[f"{prefix}{hc}.base"] = (num_mix,)
            tensors[f"{prefix}{hc}.scale"] = (3,)
    tensors["model.norm.weight"] = (config.hidden_size,)
    tensors["model.hc_head.hc_fn"] = (config.hc_mult, config.hc_mult * config.hidden_size)
    tensors["model.hc_head.hc_base"] = (config.hc_mult,)
    tensors["model.hc_head.hc_scale"] = (1,)
    tensors["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return tensors


def _attention_tensors(config: ModelConfig, layer_idx: int) -> dict[str, tuple[int, ...]]:
    heads, head_dim, hidden, q_rank = (
        config.num_attention_heads, config.head_dim, config.hidden_size, config.q_lora_rank,
    )  # fmt: skip
    groups, o_rank = config.o_groups, config.o_lora_rank
    tensors = {
        "self_attn.sinks": (heads,),
        "self_attn.q_a_proj.weight": (q_rank, hidden),
        "self_attn.q_a_norm.weight": (q_rank,),
        "self_attn.q_b_proj.weight": (heads * head_dim, q_rank),
        "self_attn.kv_proj.weight": (head_dim, hidden),
        "self_attn.kv_norm.weight": (head_dim,),
        "self_attn.o_a_proj.weight": (groups * o_rank, heads * head_dim // groups),
        "self_attn.o_b_proj.weight": (hidden, groups * o_rank),
    }
    layer_type = config.layer_types[layer_idx]
    if layer_type == SLIDING:
        return tensors
    rate = config.compress_rate(layer_idx)
    width = 2 * head_dim if layer_type == CSA else head_dim  # CSA windows overlap: two halves per entry
    tensors |= _compressor_tensors("self_attn.compressor.", rate, width, head_dim, hidden)
    if layer_type == CSA:
        index_dim, index_heads = config.index_head_dim, config.index_n_heads
        indexer = "self_attn.compressor.indexer."
        tensors |= _compressor_tensors(indexer, rate, 2 * index_dim, index_dim, hidden)
        tensors[indexer + "q_b_proj.weight"] = (index_heads * index_dim, q_rank)
        tensors[indexer + "scorer.weights_proj.weight"] = (index_heads, hidden)
    return tensors


def _compressor_tensors(prefix: str, rate: int, width: int, head_dim: int, hidden: int) -> dict:
    return {
        prefix + "position_bias": (rate, width),
        prefix + "kv_proj.weight": (width, hidden),
        prefix + "gate_proj.weight": (width, hidden),
        prefix + "kv_norm.weight": (head_dim,),
    }


def _mlp_tensors(config: ModelConfig, layer_idx: int) -> dict[str, tuple[int, ...]]:
    experts, hidden, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    tensors = {"mlp.gate.weight": (experts, hidden)}
    if config.mlp_layer_types[layer_idx] == "hash_moe":
        tensors["mlp.gate.tid2eid"] = (config.vocab_size, config.num_experts_per_tok)
    else:
        tensors["mlp.gate.e_score_correction_bias"] = (experts,)
    return tensors | {
        "mlp.experts.gate_up_proj": (experts, 2 * inter, hidden),
        "mlp.experts.down_proj": (experts, hidden, inter),
        "mlp.shared_experts.gate_proj.weight": (inter, hidden),
        "mlp.shared_experts.up_proj.weight": (inter, hidden),
        "mlp.shared_experts.down_proj.weight": (hidden, inter),
    }


def is_fp32_tensor(name: str) -> bool:
    """Whether the internal tensor `name` stays float32 in every compute dtype (norms, mHC, sinks...)."""
    return _FP32_PATTERN.search(name) is not None


def is_integer_tensor(name: str) -> bool:
    """Whether the internal tensor `name` holds integers (the hash-routing table `tid2eid`, int64)."""
    return name.endswith(".tid2eid")


# ---------------------------------------------------------------------- the official layout table

_TOP_LEVEL = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_PER_LAYER = {  # model.layers.N.<key> -> layers.N.<value>
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
}
_EXPERTS = {"mlp.experts.gate_up_proj": ("w1", "w3"), "mlp.experts.down_proj": ("w2",)}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


# transformers >= 5 `save_pretrained` writes official names under `model.`, except these spellings
_TRANSFORMERS_SAVED = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_TRANSFORMERS_SAVED_KV_NORM = re.compile(r"(layers\.\d+\.attn\.)kv_norm\.weight")
LAYOUTS = ("hf", "official", "transformers")
_LAYOUT_PATTERNS = {  # a name that only this layout has
    "hf": re.compile(
        r"model\.layers\.\d+\.(self_attn|mlp|attn_hc|ffn_hc|input_layernorm|post_attention_layernorm)\.|lm_head\."
    ),
    "official": re.compile(r"layers\.\d+\.|embed\.weight$"),
    "transformers": re.compile(r"model\.layers\.\d+\.(attn\.|ffn\.|hc_attn_|hc_ffn_)"),
}


@dataclass(frozen=True)
class SourcePlan:
    """How one internal tensor is stored: its source tensors, each of `source_shape`, and how they join.

    `join` is "copy" (one source), "stack" (one source per expert, stacked on dim 0) or "stack_pairs"
    (sources are all experts' first halves then all second halves; per expert cat(first, second)).
    """

    target: str
    sources: tuple[str, ...]
    source_shape: tuple[int, ...]
    join: str = "copy"

    def combine(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The internal tensor from its source tensors (in `sources` order)."""
        if self.join == "copy":
            return parts[0]
        if self.join == "stack":
            return torch.stack(parts)
        half = len(parts) // 2
        return torch.stack([torch.cat(pair) for pair in zip(parts[:half], parts[half:], strict=True)])

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The source tensors (in `sources` order) of an internal tensor; inverse of `combine`."""
        if self.join == "copy":
            return [tensor]
        rows = self.source_shape[0]
        parts = [expert.split(rows) for expert in tensor]  # [expert][part]
        return [parts[expert][part] for part in range(len(parts[0])) for expert in range(len(parts))]


def source_plans(config: ModelConfig, layout: str) -> dict[str, SourcePlan]:
    """For every expected internal tensor, the on-disk tensors it is stored as in `layout`.

    Layouts: "hf" (internal names), "official" (DeepSeek's release), "transformers" (what
    transformers >= 5 `save_pretrained` writes: the official names under `model.`, with a few spellings
    of its own; see `_TRANSFORMERS_SAVED`).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    plans = {}
    for name, shape in expected_tensors(config).items():
        if layout == "hf":
            plans[name] = SourcePlan(name, (name,), shape)
            continue
        plan = _official_plan(name, shape)
        if layout == "transformers":
            plan = SourcePlan(
                name, tuple(map(_saved_by_transformers, plan.sources)), plan.source_shape, plan.join
            )
        plans[name] = plan
    return plans


def _official_plan(name: str, shape: tuple[int, ...]) -> SourcePlan:
    if name in _TOP_LEVEL:
        return SourcePlan(name, (_TOP_LEVEL[name],), shape)
    layer, key = _LAYER_NAME.fullmatch(name).groups()
    if key not in _EXPERTS:
        return SourcePlan(name, (f"layers.{layer}.{_PER_LAYER[key]}",), shape)
    parts = _EXPERTS[key]
    sources = tuple(f"layers.{layer}.ffn.experts.{e}.{p}.weight" for p in parts for e in range(shape[0]))
    join = "stack_pairs" if len(parts) == 2 else "stack"
    return SourcePlan(name, sources, (shape[1] // len(parts), shape[2]), join)


def _saved_by_transformers(official: str) -> str:
    if official in _TRANSFORMERS_SAVED:
        return _TRANSFORMERS_SAVED[official]
    return "model." + _TRANSFORMERS_SAVED_KV_NORM.sub(r"\1norm.weight", official)


def detect_layout(names: list[str] | dict) -> str:
    """Tell the layout from tensor names: internal `model.layers.N.self_attn...` ("hf"), DeepSeek's
    `layers.N.attn...` ("official") or transformers' saved `model.layers.N.attn...` ("transformers")."""
    used = [n for n in names if not n.startswith(IGNORED_PREFIXES)]
    found = {layout: any(pattern.match(n) for n in used) for layout, pattern in _LAYOUT_PATTERNS.items()}
    layouts = [layout for layout, is_found in found.items() if is_found]
    if len(layouts) != 1:
        raise CheckpointError(
            f"cannot tell the checkpoint layout from its tensor names (e.g. {sorted(used)[:5]}): expected "
            f"one of transformers' module names ('model.layers.0.self_attn...'), DeepSeek's names "
            f"('layers.0.attn...') or transformers' saved names ('model.layers.0.attn...'); found {layouts}"
        )
    return layouts[0]
