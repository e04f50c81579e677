"""The DeepSeek-V4 tensor schema, read from the modules, and the one table between the checkpoint layouts.

The modules are the schema: `tensor_schema(model)` reads every tensor's internal name, shape and dtype
from a model's `state_dict()`, and `meta_model(config, dtype)` builds that model on the meta device (no
memory). Internal names are transformers' `save_pretrained` names for `DeepseekV4ForCausalLM`. Which
parameters stay float32 is declared once, in the modules (`layers.FP32`); everything here reads it.

This module only adds what the modules cannot say: how each tensor is stored on disk. Layouts:

- "hf": what transformers writes; names are the internal names.
- "official": DeepSeek's release layout (`embed.weight`, `layers.N.attn.wq_a.weight`,
  `layers.N.ffn.experts.E.w1.weight`, ...), mapped by `_TOP_LEVEL` and `_PER_LAYER` below. Per-expert
  `w1` (gate) and `w3` (up) merge into `experts.gate_up_proj[E, 2I, H]` = cat(w1, w3) per expert, and
  `w2` stacks into `experts.down_proj[E, H, I]`.
- "transformers": what transformers >= 5 `save_pretrained` writes (official names under `model.`).

The multi-token-prediction layer (`mtp.<i>.*`, `deepinfer_core.models.deepseek_v4.mtp`) is not part of the model's
plans (`source_plans` leaves it out; `IGNORED_PREFIXES`): `mtp_source_plans` maps it the same way, its
decoder-layer tensors by `_PER_LAYER` / `_EXPERTS` under `mtp.<i>.` and its own by `_MTP_OWN`, stored
(and quantised) like the layers'.

Storage dtypes (safetensors header names), checked for every tensor by `SourcePlan.stored_dtypes`:
floating tensors in the checkpoint's float dtype (config.json's `torch_dtype` / `dtype`) or F32; integer
tables in any integer dtype; weights that follow the compute dtype and have two or more dims may be FP8
e4m3 with block scales; routed experts may be packed FP4 (I8/U8) with group scales.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from deepinfer_core.config import CheckpointError, ModelConfig
from deepinfer_core.models import registry

IGNORED_PREFIXES = ("mtp.", "model.mtp.")
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
"""Plain floating storage, by safetensors header name."""
INTEGER_DTYPES = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")
FP8_DTYPE = "F8_E4M3"
FP4_PACKED_DTYPES = ("I8", "U8")
SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")
"""Storage of FP8 block scales and FP4 group scales."""


# ---------------------------------------------------------------------- the schema, from the modules


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a model declares: its shape and the dtype it is loaded in."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def meta_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of `config` (its class from the registry) at compute dtype `dtype`, built on the meta
    device (holds no memory)."""
    model_cls = registry.model_class(config)
    with torch.device("meta"):
        return model_cls(config, model_cls.layer_plan(config, dtype), dtype)


def tensor_schema(model: nn.Module) -> dict[str, TensorSpec]:
    """Every tensor `model` declares (parameters and persistent buffers), in `state_dict()` order."""
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model of `config` needs, internal name -> shape (from the modules)."""
    return {name: spec.shape for name, spec in tensor_schema(meta_model(config)).items()}


def is_integer_tensor(name: str) -> bool:
    """Whether the internal tensor `name` holds integers (the hash-routing table `tid2eid`, int64).

    For writers that have only a name; the loader reads `SourcePlan.is_integer`, from the modules."""
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
_MTP_OWN = {  # the MTP layer's own tensors: mtp.<i>.<key> -> mtp.<i>.<value> (official)
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}


# transformers >= 5 `save_pretrained` writes official names under `model.`, except these spellings
_TRANSFORMERS_SAVED = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_TRANSFORMERS_SAVED_KV_NORM = re.compile(r"((?:layers|mtp)\.\d+\.attn\.)kv_norm\.weight")
LAYOUTS = ("hf", "official", "transformers")
_LAYOUT_PATTERNS = {  # a name that only this layout has (of the layers, or of an MTP layer)
    "hf": re.compile(
        r"(model\.layers|mtp)\.\d+\.(self_attn|mlp|attn_hc|ffn_hc|input_layernorm|post_attention_layernorm)\."
        r"|lm_head\."
    ),
    "official": re.compile(r"layers\.\d+\.|mtp\.\d+\.(attn|ffn)\.|embed\.weight$"),
    "transformers": re.compile(r"model\.(layers|mtp)\.\d+\.(attn\.|ffn\.|hc_attn_|hc_ffn_)"),
}


@dataclass(frozen=True)
class SourcePlan:
    """How one internal tensor is stored: its source tensors, each of `source_shape`, and how they join.

    `join` is "copy" (one source), "stack" (one source per expert, stacked on dim 0) or "stack_pairs"
    (sources are all experts' first halves then all second halves; per expert cat(first, second)).
    `is_integer`: an integer table. `quantised`: the quantised storage a source may have ("fp8": e4m3
    with block scales; "fp4": packed e2m1 with group scales, routed experts only).
    """

    target: str
    sources: tuple[str, ...]
    source_shape: tuple[int, ...]
    join: str = "copy"
    is_integer: bool = False
    quantised: tuple[str, ...] = ()

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

    def stored_dtypes(self, float_dtype: str | None) -> tuple[str, ...]:
        """Safetensors dtypes a source may have when stored plainly (not quantised): any integer dtype
        for an integer table, else the checkpoint's `float_dtype` or F32 (any float dtype if None)."""
        if self.is_integer:
            return INTEGER_DTYPES
        return tuple(FLOAT_DTYPES) if float_dtype is None else tuple(dict.fromkeys((float_dtype, "F32")))


def source_plans(config: ModelConfig, layout: str) -> dict[str, SourcePlan]:
    """For every tensor of the model of `config`, the on-disk tensors it is stored as in `layout`.

    Layouts: "hf" (internal names), "official" (DeepSeek's release), "transformers" (what
    transformers >= 5 `save_pretrained` writes: the official names under `model.`, with a few spellings
    of its own; see `_TRANSFORMERS_SAVED`).
    """
    # at a half-precision compute dtype, the tensors that follow it are the ones a checkpoint may quantise
    return _plans(tensor_schema(meta_model(config, torch.bfloat16)), layout, _official_plan, "")


def mtp_source_plans(config: ModelConfig, layout: str, num_layers: int) -> dict[str, SourcePlan]:
    """For every tensor of the checkpoint's `num_layers` MTP layers, the on-disk tensors it is stored as
    in `layout`, keyed by the `MultiTokenPredictor`'s own names (`0.self_attn.q_a_proj.weight`; on disk
    `mtp.0.self_attn.q_a_proj.weight`, `mtp.0.attn.wq_a.weight`, `model.mtp.0.attn.wq_a.weight`).

    Quantised storage is allowed as for the layers (`_quantised`): FP8 for any 2-D weight that follows
    the compute dtype, packed FP4 also for the routed experts."""
    from deepinfer_core.models.deepseek_v4.mtp import MTP_PREFIX, MultiTokenPredictor

    with torch.device("meta"):
        schema = tensor_schema(MultiTokenPredictor(config, torch.bfloat16, num_layers))
    return _plans(schema, layout, _official_mtp_plan, MTP_PREFIX)


def _plans(schema: dict[str, TensorSpec], layout: str, official_plan, hf_prefix: str) -> dict[str, SourcePlan]:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    plans = {}
    for name, spec in schema.items():
        if layout == "hf":
            plan = SourcePlan(name, (hf_prefix + name,), spec.shape)
        else:
            plan = official_plan(name, spec.shape)
        if layout == "transformers":
            plan = replace(plan, sources=tuple(map(_saved_by_transformers, plan.sources)))
        is_integer = not spec.dtype.is_floating_point
        plans[name] = replace(plan, is_integer=is_integer, quantised=_quantised(name, spec))
    return plans


def _quantised(name: str, spec: TensorSpec) -> tuple[str, ...]:
    if spec.dtype != torch.bfloat16 or len(spec.shape) < 2:
        return ()
    return ("fp8", "fp4") if name.endswith(tuple(_EXPERTS)) else ("fp8",)  # a layer's routed experts


def _official_plan(name: str, shape: tuple[int, ...]) -> SourcePlan:
    if name in _TOP_LEVEL:
        return SourcePlan(name, (_TOP_LEVEL[name],), shape)
    layer, key = _LAYER_NAME.fullmatch(name).groups()
    return _layer_plan(name, f"layers.{layer}.", key, shape)


def _official_mtp_plan(name: str, shape: tuple[int, ...]) -> SourcePlan:
    layer, key = name.split(".", 1)
    if key in _MTP_OWN:
        return SourcePlan(name, (f"mtp.{layer}.{_MTP_OWN[key]}",), shape)
    return _layer_plan(name, f"mtp.{layer}.", key, shape)


def _layer_plan(name: str, prefix: str, key: str, shape: tuple[int, ...]) -> SourcePlan:
    """The plan of decoder-layer tensor `key` stored under the official `prefix` (`layers.N.`, `mtp.N.`)."""
    if key not in _EXPERTS:
        return SourcePlan(name, (prefix + _PER_LAYER[key],), shape)
    parts = _EXPERTS[key]
    sources = tuple(f"{prefix}ffn.experts.{e}.{p}.weight" for p in parts for e in range(shape[0]))
    join = "stack_pairs" if len(parts) == 2 else "stack"
    return SourcePlan(name, sources, (shape[1] // len(parts), shape[2]), join)


def _saved_by_transformers(official: str) -> str:
    if official in _TRANSFORMERS_SAVED:
        return _TRANSFORMERS_SAVED[official]
    return "model." + _TRANSFORMERS_SAVED_KV_NORM.sub(r"\1norm.weight", official)


def embedding_source(layout: str) -> str:
    """The on-disk name of the token embedding in `layout` (never quantised: its dtype is the checkpoint's)."""
    if layout == "hf":
        return "model.embed_tokens.weight"
    official = _TOP_LEVEL["model.embed_tokens.weight"]
    return _saved_by_transformers(official) if layout == "transformers" else official


def detect_layout(names: list[str] | dict) -> str:
    """Tell the layout from tensor names: internal `model.layers.N.self_attn...` ("hf"), DeepSeek's
    `layers.N.attn...` ("official") or transformers' saved `model.layers.N.attn...` ("transformers"); from
    the MTP layer's names (`mtp.N.self_attn...`, `mtp.N.attn...`, `model.mtp.N.attn...`) only when there
    are no others (a file of the MTP layer beside weights given in memory)."""
    used = [n for n in names if not n.startswith(IGNORED_PREFIXES)] or list(names)
    found = {layout: any(pattern.match(n) for n in used) for layout, pattern in _LAYOUT_PATTERNS.items()}
    layouts = [layout for layout, is_found in found.items() if is_found]
    if len(layouts) != 1:
        raise CheckpointError(
            f"cannot tell the checkpoint layout from its tensor names (e.g. {sorted(used)[:5]}): expected "
            f"one of transformers' module names ('model.layers.0.self_attn...'), DeepSeek's names "
            f"('layers.0.attn...') or transformers' saved names ('model.layers.0.attn...'); found {layouts}"
        )
    return layouts[0]
