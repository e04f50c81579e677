"""Tensor parallelism for DeepSeek-V4: which slice of each tensor a rank owns, and where partial sums meet.

V4's attention is MQA-like: one shared K=V head, 64 query heads, and a grouped low-rank output
(`o_a_proj`: each of `o_groups` groups of consecutive heads maps to its own `o_lora_rank` outputs;
`o_b_proj` mixes all groups back to the hidden size). Over `T` ranks:

- column-parallel (split by output rows): `q_b_proj` (a rank's query heads), `o_a_proj` (the groups of
  exactly those heads, so the grouped projection needs no communication), the attention `sinks`, the
  shared expert's `gate_proj`/`up_proj`, and each routed expert's gate and up rows (`gate_up_proj`,
  gate half and up half split alike);
- row-parallel (split by input columns): `o_b_proj` and the experts' `down_proj`s; their outputs are
  partial sums, all-reduced once after the attention block and once after the MoE block (routed plus
  shared expert, one reduction for both);
- replicated: everything that acts on the single KV head or on whole tokens: `q_a_proj` and its norm
  (the norm needs the whole low-rank vector), `kv_proj`, the CSA/HCA compressors and the lightning
  indexer (their outputs are per-token, one head wide: splitting the indexer's heads would need an
  all-reduce of the `[tokens, entries]` scores before the top-k, larger than the work saved), the
  router, the mHC hyper-connections, the norms, the embedding and the LM head. The KV cache is one
  head, so every rank holds all of it.

A rank's model is the model of `shard_config(config, T)` (fewer heads, groups and expert width), so the
modules, the layer plan and the backends' specs all describe the local shard; `tensor_shards` says how
each checkpoint tensor is cut, and the loader reads only those slices (`Shard.source_shard`).

The MTP drafter's layer (`mtp.<i>.*`) is a decoder layer of the same shapes: its heads, groups and
expert width are cut by the same rules (`mtp_tensor_shards`) and its two partial sums meet the same
way, while its own input projections, norms and head collapse are replicated; so every rank computes
the same drafts.

DeepSeek-V4.1 (`layers.N.*` names) is cut by the same rules; `tensor_parallel_v41` lists its tensors and
says why each of its additions (MoE `bias`/`bias_vl`, Engram, the two-level indexer, single-pass mHC) is
replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from deepinfer_core.backends import quant
from deepinfer_core.config import ConfigError, ModelConfig
from deepinfer_core.models.tensor_parallel_v41 import V41_LAYER_NAME, V41_PER_LAYER


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`'s part of a tensor along `dim`. The dim is `parts` equal pieces laid end to
    end (gate rows then up rows: 2), each split evenly, and the rank's slices of each are concatenated."""

    dim: int
    rank: int
    size: int
    parts: int = 1

    def ranges(self, length: int) -> list[tuple[int, int]]:
        """`(start, stop)` of each of the rank's slices along a dim of `length` elements."""
        if length % (self.parts * self.size):
            raise ConfigError(
                f"a dim of {length} does not split into {self.parts} x {self.size} equal tensor-parallel "
                f"slices; choose a tensor_parallel_size that divides it"
            )
        part, piece = length // self.parts, length // (self.parts * self.size)
        return [(p * part + self.rank * piece, p * part + (self.rank + 1) * piece) for p in range(self.parts)]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's slice of a whole `tensor`."""
        pieces = [tensor.narrow(self.dim, a, b - a) for a, b in self.ranges(tensor.shape[self.dim])]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def source_shard(self, join: str) -> Shard:
        """The same cut of one on-disk source tensor of a tensor joined by `join` (`SourcePlan.join`):
        per-expert sources lack the expert dim, and each of `stack_pairs`' sources is one part."""
        if join == "copy":
            return self
        return Shard(self.dim - 1, self.rank, self.size, 1 if join == "stack_pairs" else self.parts)


_COLUMN = 0
_PER_LAYER = {  # model.layers.N.<key> -> (dim, parts)
    "self_attn.q_b_proj.weight": (_COLUMN, 1),
    "self_attn.o_a_proj.weight": (_COLUMN, 1),
    "self_attn.sinks": (_COLUMN, 1),
    "self_attn.o_b_proj.weight": (1, 1),
    "mlp.shared_experts.gate_proj.weight": (_COLUMN, 1),
    "mlp.shared_experts.up_proj.weight": (_COLUMN, 1),
    "mlp.shared_experts.down_proj.weight": (1, 1),
    "mlp.experts.gate_up_proj": (1, 2),
    "mlp.experts.gate_up_proj_scale": (1, 2),
    "mlp.experts.down_proj": (2, 1),
    "mlp.experts.down_proj_scale": (2, 1),
}
_LAYER_NAME = re.compile(r"(?:model\.layers|mtp)\.\d+\.(.+)")  # the MTP's decoder layer is cut alike
_MTP_PREFIX = "mtp."


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise `ConfigError` unless `config`'s heads, output groups and expert width split over `size` ranks
    (`NotImplementedError` for a family without tensor parallelism, `ModelCapabilities`). The MTP drafter's decoder layer
    has the target layers' shapes, so it splits whenever they do."""
    config.capabilities.check_parallel(config.model_type, "tensor", size)
    problems = [
        f"{name} ({value}) is not a multiple of tensor_parallel_size ({size})"
        for name, value in (("num_attention_heads", config.num_attention_heads), ("o_groups", config.o_groups),
                            ("moe_intermediate_size", config.moe_intermediate_size))
        if value % size
    ]
    if not problems and size > 1 and config.expert_dtype == "fp4" and (config.moe_intermediate_size // size) % quant.FP4_GROUP_SIZE:
        problems.append(f"FP4 experts' moe_intermediate_size / tensor_parallel_size "
                        f"({config.moe_intermediate_size // size}) is not a multiple of {quant.FP4_GROUP_SIZE}")
    if problems:
        raise ConfigError(f"tensor_parallel_size={size} does not fit the model: " + "; ".join(problems))


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's model is built from: `1/size` of the query heads, output groups and expert
    width (everything else as in `config`)."""
    check_tensor_parallel(config, size)
    if size == 1:
        return config
    return config.model_copy(update={
        "num_attention_heads": config.num_attention_heads // size,
        "o_groups": config.o_groups // size,
        "moe_intermediate_size": config.moe_intermediate_size // size,
    })


def tensor_shards(names, rank: int, size: int) -> dict[str, Shard]:
    """For each internal tensor name in `names` that tensor parallelism cuts, rank `rank`'s `Shard`
    (names not in the result are replicated)."""
    if size == 1:
        return {}
    shards = {}
    for name in names:
        rule = _cut_rule(name)
        if rule is not None:
            shards[name] = Shard(rule[0], rank, size, rule[1])
    return shards


def _cut_rule(name: str) -> tuple[int, int] | None:
    """`(dim, parts)` of a V4 (`model.layers.N.*`, `mtp.N.*`) or V4.1 (`layers.N.*`) tensor, None: replicated."""
    for pattern, rules in ((_LAYER_NAME, _PER_LAYER), (V41_LAYER_NAME, V41_PER_LAYER)):
        match = pattern.fullmatch(name)
        if match:
            return rules.get(match.group(1))
    return None


def mtp_tensor_shards(names, rank: int, size: int) -> dict[str, Shard]:
    """`tensor_shards` for the MTP module's tensor `names` (`0.self_attn.q_b_proj.weight`: `mtp.`
    stripped): its decoder layer is cut exactly as a target layer is; `e_proj`, `h_proj`, `enorm`,
    `hnorm`, `hc_head` and `norm` act on whole tokens and are replicated, like the shared embedding and
    LM head."""
    prefixed = tensor_shards([_MTP_PREFIX + name for name in names], rank, size)
    return {name[len(_MTP_PREFIX) :]: shard for name, shard in prefixed.items()}


def shard_weights(weights: dict[str, torch.Tensor], shards: dict[str, Shard]) -> dict[str, torch.Tensor]:
    """In-memory whole weights (internal names) cut to one rank's slices."""
    return {name: shards[name].take(t) if name in shards else t for name, t in weights.items()}


# ---------------------------------------------------------------------- reading only a rank's slices


def _index(ndim: int, dim: int, start: int, stop: int) -> tuple[slice, ...]:
    return tuple(slice(start, stop) if d == dim else slice(None) for d in range(ndim))


def read_slices(reader, name: str, shard: Shard, device, unit: int = 1) -> torch.Tensor:
    """The stored tensor `name`'s slices of `shard` (`reader`: a `SafetensorsReader`), read from the file.

    `unit`: stored elements per shard element along the cut dim are `1 / unit` (FP4 codes hold two
    inputs a byte, `unit=2`; their group scales one per 32, `unit=32`) -- the cut is the logical one."""
    shape = reader.shape(name)
    logical = shape[shard.dim] * unit
    pieces = [reader.read_slice(name, _index(len(shape), shard.dim, a // unit, b // unit)).to(device)
              for a, b in shard.ranges(logical)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)


def read_fp8_slices(reader, name: str, shard: Shard, block: tuple[int, int], device) -> torch.Tensor:
    """Dequantised slices of the FP8 tensor `name` (block scales beside it). When the cut falls on scale
    blocks only those bytes are read; otherwise the whole tensor is read and cut after dequantising."""
    shape, scale_name = reader.shape(name), reader.scale_name(name)
    ranges = shard.ranges(shape[shard.dim])
    size = block[shard.dim - len(shape) + 2] if shard.dim >= len(shape) - 2 else 1
    aligned = all(a % size == 0 and (b % size == 0 or b == shape[shard.dim]) for a, b in ranges)
    if not aligned:
        whole = quant.dequantize_fp8(reader.read(name).to(device), reader.read(scale_name).to(device), block)
        return shard.take(whole)
    scale_dim = shard.dim
    pieces = []
    for a, b in ranges:
        raw = reader.read_slice(name, _index(len(shape), shard.dim, a, b)).to(device)
        scale_index = _index(len(reader.shape(scale_name)), scale_dim, a // size, -(-b // size))
        pieces.append(quant.dequantize_fp8(raw, reader.read_slice(scale_name, scale_index).to(device), block))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)


# ---------------------------------------------------------------------- where the partial sums meet


def all_reduce(x: torch.Tensor, group_info) -> torch.Tensor:
    """Sum a row-parallel block's partial outputs over the tensor-parallel ranks of `group_info` (the
    rank's `GroupInfo` for "tp"), in place; a group of one returns `x` untouched."""
    if group_info.size > 1:
        import torch.distributed as dist

        dist.all_reduce(x, group=group_info.group)
    return x
