"""Checkpoint loading: safetensors (single file or sharded), every layout, FP8/FP4 dequantisation.

What tensors exist, their shapes and dtypes come from the modules (`checkpoint_layout.tensor_schema`);
their on-disk names and storage from `checkpoint_layout.source_plans`. This module reads the files,
checks every tensor's name, shape and header dtype before loading any, dequantises, joins, casts each
tensor to the dtype its module declares, and checks that every floating tensor is finite. Quantised
tensors are recognised by dtype: float8_e4m3fn with a block scale (`<name>.scale` or
`<name>.weight_scale_inv`), and, for routed experts when `quantization_config.expert_dtype == "fp4"`,
int8/uint8 packed e2m1 with per-32 scales (`quant.py`). Every failure is a `CheckpointError` naming
the file or the tensors. The model's loader leaves the MTP layer's `mtp.*` tensors alone; `read_plans`
reads them the same way from `checkpoint_layout.mtp_source_plans` (`mtp_weights.load_mtp_weights`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from deepinfer_core.backends import quant
from deepinfer_core.config import ModelConfig
from deepinfer_core.models import tensor_parallel
from deepinfer_core.models.loading.checkpoint_files import SafetensorsReader, checkpoint_files
from deepinfer_core.models.loading.checkpoint_layout import (
    FLOAT_DTYPES,
    FP4_PACKED_DTYPES,
    FP8_DTYPE,
    IGNORED_PREFIXES,
    SCALE_DTYPES,
    CheckpointError,
    SourcePlan,
    TensorSpec,
    detect_layout,
    embedding_source,
    expected_tensors,
    meta_model,
    source_plans,
    tensor_schema,
)
from deepinfer_core.models.loading.weight_digest import WeightDigest

__all__ = [
    "CheckpointError", "checkpoint_files", "expected_tensors", "load_model", "load_weights",
    "match_param_dtypes",
]  # fmt: skip

_AUTO_PROGRESS_BYTES = 512 * 2**20
_CONFIG_FLOAT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def load_model(
    model: nn.Module,
    config: ModelConfig,
    model_dir: str | Path | None,
    device: str | torch.device,
    *,
    weights: dict[str, torch.Tensor] | None = None,
    progress: bool | None = None,
) -> nn.Module:
    """Give `model` (built on the meta device) its weights on `device`, and return it.

    The weights come from the checkpoint in `model_dir`, or from `weights` (internal names) when given;
    either way each tensor is checked against `model`'s own tensors (names, shapes, finite values) and
    cast to the dtype its module declares. Raises `CheckpointError` naming every offending tensor.
    """
    schema = tensor_schema(model)
    if weights is None:
        if model_dir is None:
            raise ValueError("load_model needs a checkpoint directory or weights")
        weights = _read_checkpoint(Path(model_dir), config, schema, device, progress)
    else:
        weights = match_param_dtypes(weights, schema, device)
    model.load_state_dict(weights, strict=True, assign=True)
    return model


def load_weights(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    progress: bool | None = None,
    keep_fp4: bool = False,
    local_experts: Callable[[int], list[int]] | None = None,
    shards: dict[str, tensor_parallel.Shard] | None = None,
    keep_fp8: Collection[str] = (),
    digest: WeightDigest | None = None,
) -> dict[str, torch.Tensor]:
    """Load a checkpoint into internal names, dequantised, on `device`; `digest` is given the bytes
    read (`SafetensorsReader`).

    `local_experts(layer)` (expert parallelism): the logical experts this rank holds in layer `layer`,
    one per local slot (repeats are replicas); only those experts' tensors are read (per-expert
    checkpoints) or kept (fused ones), and the routed-expert tensors come back with that many rows.
    With `shards` (a tensor-parallel rank's, `tensor_parallel.tensor_shards`) each tensor named there
    is read only in its slices, and comes back that shape.

    With `keep_fp4` the routed experts stay in their packed FP4 bytes instead: `<name>` holds the int8
    codes and `<name>_scale` the float8_e8m0fnu group scales (`layers.FP4Experts`' parameters); an
    expert stored otherwise, or with scales that are not powers of two, raises `CheckpointError`.
    The tensors named in `keep_fp8` that are stored as block-scaled FP8 stay so: `<name>` holds the
    float8_e4m3fn values and `<name>_scale` the block scales as float32 (`layers.FP8Linear`'s parameters).

    Each tensor comes back in the dtype the model's module declares at compute dtype `dtype` (norms,
    mHC parameters and sinks stay float32; `tid2eid` is int64). Every tensor is checked before any is
    read (missing, unexpected, misshaped or mistyped ones raise one `CheckpointError` naming all of
    them), and every floating tensor is checked to be finite after loading. `progress` shows a bar
    (None: only for checkpoints over 512 MiB).
    """
    return _read_checkpoint(
        Path(model_dir), config, tensor_schema(meta_model(config, dtype)), device, progress, keep_fp4,
        frozenset(keep_fp8), local_experts, shards or {}, digest,
    )


def match_param_dtypes(
    weights: dict[str, torch.Tensor], schema: dict[str, TensorSpec], device: str | torch.device,
    host: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Given weights (internal names) checked against `schema` (names, shapes), each cast to its
    declared dtype on `device` (those named in `host` in host memory instead, pinned where CUDA is:
    `host_weight_names`), and checked to be finite."""
    missing = sorted(set(schema) - set(weights))
    unexpected = sorted(set(weights) - set(schema))
    misshaped = [
        f"{name} has shape {list(tensor.shape)}, expected {list(schema[name].shape)}"
        for name, tensor in weights.items()
        if name in schema and tuple(tensor.shape) != schema[name].shape
    ]
    _raise_problems(
        "the given weights do not match the model", missing, ("unexpected tensors", unexpected), misshaped, []
    )
    loaded = {name: to_host(weights[name].to(dtype=spec.dtype)) if name in host
              else weights[name].to(device=device, dtype=spec.dtype) for name, spec in schema.items()}
    finite = _FiniteCheck()
    for name, tensor in loaded.items():
        finite.add(name, tensor)
    finite.raise_if_any("the given weights")
    return loaded


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in host memory, pinned where CUDA is present (a pinned one is returned as it is)."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if torch.cuda.is_available() and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor


# ---------------------------------------------------------------------- reading a checkpoint


def _read_checkpoint(
    model_dir: Path, config: ModelConfig, schema: dict[str, TensorSpec], device, progress: bool | None,
    keep_fp4: bool = False,
    keep_fp8: frozenset[str] = frozenset(),
    local_experts: Callable[[int], list[int]] | None = None,
    shards: dict[str, tensor_parallel.Shard] | None = None,
    digest: WeightDigest | None = None,
) -> dict[str, torch.Tensor]:
    files = checkpoint_files(model_dir)
    layout = detect_layout(list(files))
    plans = source_plans(config, layout)
    if set(plans) != set(schema):  # the model asked for is not the model of `config`
        raise ValueError(
            f"the model's tensors differ from {config.model_type}'s: {sorted(set(plans) ^ set(schema))}"
        )
    if config.tie_word_embeddings and plans["lm_head.weight"].sources[0] not in files:
        plans["lm_head.weight"] = plans["model.embed_tokens.weight"]
    return read_plans(model_dir, files, layout, plans, config, schema, device, progress, keep_fp4=keep_fp4,
                      keep_fp8=keep_fp8, local_experts=local_experts, shards=shards, digest=digest)


def read_plans(
    model_dir: Path, files: dict[str, Path], layout: str, plans: dict[str, SourcePlan], config: ModelConfig,
    schema: dict[str, TensorSpec], device, progress: bool | None, *,
    keep_fp4: bool = False,
    keep_fp8: frozenset[str] = frozenset(),
    local_experts: Callable[[int], list[int]] | None = None,
    shards: dict[str, tensor_parallel.Shard] | None = None,
    is_mtp: bool = False,
    digest: WeightDigest | None = None,
) -> dict[str, torch.Tensor]:
    """Read the tensors of `plans` (internal name -> how it is stored) from the checkpoint `files`
    (`checkpoint_files`) of `layout` (`detect_layout`), each checked first and built as `load_weights` describes (dequantised, or kept
    packed / FP8 under `keep_fp4` / `keep_fp8`) in its `schema` dtype on `device`. `is_mtp`: the plans
    are the MTP layer's (`checkpoint_layout.mtp_source_plans`), and the checkpoint's other `mtp.*`
    tensors, not the model's, are the unexpected ones. `digest` is given every byte read."""
    shards = shards or {}
    if progress is None:
        progress = sum(path.stat().st_size for path in set(files.values())) > _AUTO_PROGRESS_BYTES
    with ExitStack() as stack:
        reader = SafetensorsReader(files, stack, digest)
        _Check(plans, reader, config, embedding_source(layout), is_mtp).raise_if_any(model_dir, layout)
        finite = _FiniteCheck()
        weights = {}
        local = {name: _local_plan(plan, local_experts) for name, plan in plans.items()}
        bar = _progress_bar(reader, [plan for plan, _ in local.values()], is_mtp, progress)
        stack.callback(bar.close)
        for count, (name, (plan, keep_rows)) in enumerate(local.items(), 1):
            if progress:
                bar.update(_source_bytes(reader, plan))
                bar.set_postfix_str(f"{count}/{len(local)} tensors", refresh=False)
            shard = shards.get(name)
            if keep_fp4 and "fp4" in plan.quantised:
                weights[name], weights[f"{name}_scale"] = _build_fp4(plan, reader, device, shard)
                if keep_rows is not None:
                    weights[name], weights[f"{name}_scale"] = weights[name][keep_rows], weights[f"{name}_scale"][keep_rows]
                finite.add(f"{name}_scale", weights[f"{name}_scale"])
                continue
            if (name in keep_fp8 and shard is None and plan.join == "copy"  # kept whole in FP8 (a TP slice is not)
                    and reader.dtype(plan.sources[0]) == FP8_DTYPE):
                source = plan.sources[0]
                weights[name] = reader.read(source).to(device)
                weights[f"{name}_scale"] = reader.read(reader.scale_name(source)).to(device, torch.float32)
                finite.add(name, weights[name])
                finite.add(f"{name}_scale", weights[f"{name}_scale"])
                continue
            weights[name] = _build(plan, reader, config, schema[name].dtype, device, shard)
            if keep_rows is not None:  # a fused tensor of every expert: keep the local ones
                weights[name] = weights[name][keep_rows]
            finite.add(name, weights[name])
        finite.raise_if_any(str(model_dir))
    _check_tid2eid(weights, config)
    return weights


def _source_bytes(reader: SafetensorsReader, plan: SourcePlan) -> int:
    return sum(reader.nbytes(source) for source in plan.sources)  # scales left out: a fraction of a percent


def _progress_bar(reader: SafetensorsReader, plans: list[SourcePlan], is_mtp: bool, progress: bool) -> tqdm:
    """The weights' progress bar: bytes of the checkpoint read and tensors built, naming the rank."""
    import torch.distributed as dist

    rank = f" (rank {dist.get_rank()})" if dist.is_available() and dist.is_initialized() else ""
    total = sum(_source_bytes(reader, plan) for plan in plans) if progress else 0
    return tqdm(total=total, desc=f"Loading {'MTP ' if is_mtp else ''}weights{rank}", unit="B", unit_scale=True,
                    unit_divisor=1024, disable=not progress, position=dist.get_rank() if rank else None)


def _local_plan(plan: SourcePlan, local_experts: Callable[[int], list[int]] | None):
    """`(plan reading only the local experts, rows to keep after reading or None)` of a routed-expert
    tensor under expert parallelism; `(plan, None)` for every other tensor."""
    key = _EXPERT_TARGET.fullmatch(plan.target) if local_experts is not None else None
    if key is None:
        return plan, None
    experts = local_experts(int(key.group(1)))
    if plan.join == "copy":
        return plan, torch.tensor(experts)
    per_part = len(plan.sources) // (2 if plan.join == "stack_pairs" else 1)
    parts = [plan.sources[start : start + per_part] for start in range(0, len(plan.sources), per_part)]
    return replace(plan, sources=tuple(part[e] for part in parts for e in experts)), None


_EXPERT_TARGET = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.\w+")


class _Check:
    """Checks every source tensor's presence, header dtype and shape (and its scale's) before any is read."""

    def __init__(self, plans: dict[str, SourcePlan], reader: SafetensorsReader, config: ModelConfig,
                 embedding: str, is_mtp: bool = False) -> None:
        self.reader, self.config, self.is_mtp = reader, config, is_mtp
        self.missing: list[str] = []
        self.misshaped: list[str] = []
        self.mistyped: list[str] = []
        self.consumed: set[str] = set()
        self.float_dtype, self.float_origin = self._float_dtype(embedding)
        for plan in plans.values():
            for source in plan.sources:
                self._check_source(plan, source)

    def _float_dtype(self, embedding: str) -> tuple[str | None, str]:
        """The checkpoint's float storage dtype and where it was read: config.json's declared dtype, else
        the embedding's (`embedding`, its on-disk name; never quantised)."""
        declared = _CONFIG_FLOAT_DTYPES.get(self.config.checkpoint_dtype or "")
        if declared is not None:
            return declared, f"config.json's dtype {self.config.checkpoint_dtype!r}"
        stored = self.reader.dtype(embedding) if embedding in self.reader.names else None
        return (stored, f"the dtype of {embedding}") if stored in FLOAT_DTYPES else (None, "")

    def _check_source(self, plan: SourcePlan, source: str) -> None:
        if source not in self.reader.names:
            self.missing.append(source)
            return
        self.consumed.add(source)
        for name, shape in self._expected_shapes(plan, source).items():
            self.consumed.add(name)
            if self.reader.shape(name) != tuple(shape):
                self.misshaped.append(
                    f"{name} has shape {list(self.reader.shape(name))}, expected {list(shape)}"
                )

    def _expected_shapes(self, plan: SourcePlan, source: str) -> dict[str, tuple[int, ...]]:
        """Check `source`'s header dtype (and its scale's); the shape each of its stored tensors must have."""
        stored = self.reader.dtype(source)
        is_fp8 = stored == FP8_DTYPE and "fp8" in plan.quantised
        is_fp4 = stored in FP4_PACKED_DTYPES and "fp4" in plan.quantised
        if not (is_fp8 or is_fp4):
            allowed = plan.stored_dtypes(self.float_dtype)
            if stored not in allowed:
                origin = f" ({self.float_origin})" if self.float_origin and not plan.is_integer else ""
                self.mistyped.append(
                    f"{source} is stored as {stored}, expected {' or '.join(allowed)}{origin}"
                )
            return {source: plan.source_shape}
        scale = self.reader.scale_name(source)
        if scale is None:
            self.missing.append(f"{source.removesuffix('.weight')}.scale (quantisation scale)")
            return {}
        if self.reader.dtype(scale) not in SCALE_DTYPES:
            self.mistyped.append(
                f"{scale} is stored as {self.reader.dtype(scale)}, expected {' or '.join(SCALE_DTYPES)}"
            )
        if is_fp8:
            return {
                source: plan.source_shape,
                scale: quant.fp8_scale_shape(plan.source_shape, _block_size(self.config)),
            }
        if self.config.expert_dtype != "fp4":
            self.misshaped.append(
                f"{source} is packed FP4 ({stored}) but quantization_config.expert_dtype is not 'fp4'"
            )
            return {scale: self.reader.shape(scale)}
        return {
            source: quant.fp4_packed_shape(plan.source_shape),
            scale: quant.fp4_scale_shape(plan.source_shape),
        }

    def raise_if_any(self, model_dir: Path, layout: str) -> None:
        unexpected = sorted(  # the model's reader leaves the MTP layer's tensors to the MTP's, and back
            n for n in self.reader.names - self.consumed if n.startswith(IGNORED_PREFIXES) == self.is_mtp
        )
        _raise_problems(
            f"checkpoint {model_dir} does not match config.json", self.missing,
            (f"unexpected tensors (for the {layout!r} layout)", unexpected), self.misshaped, self.mistyped,
        )  # fmt: skip


def _raise_problems(
    what: str,
    missing: list[str],
    unexpected: tuple[str, list[str]],
    misshaped: list[str],
    mistyped: list[str],
) -> None:
    sections = [
        f"{label}: {_listing(items)}"
        for label, items in (
            ("missing tensors", missing),
            unexpected,
            ("misshaped tensors", misshaped),
            ("tensors of the wrong dtype", mistyped),
        )
        if items
    ]
    if sections:
        raise CheckpointError(f"{what}; " + "; ".join(sections))


def _listing(items: list[str], limit: int = 20) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


class _FiniteCheck:
    """Finds tensors holding NaN or Inf with one device reduction per tensor and one host read in all.

    A float32 sum is non-finite when any element is (NaN and Inf propagate), and may also overflow for
    finite values; only the tensors whose sum is non-finite get the exact (element-wise) check."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.sums: list[torch.Tensor] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.is_floating_point():
            self.tensors[name] = tensor
            self.sums.append(tensor.sum(dtype=torch.float32))

    def raise_if_any(self, source: str) -> None:
        if not self.sums:
            return
        is_finite = torch.stack(self.sums).isfinite().tolist()
        suspects = [name for name, ok in zip(self.tensors, is_finite, strict=True) if not ok]
        bad = [
            f"{name} ({self.tensors[name].dtype})"
            for name in suspects
            if not self.tensors[name].float().isfinite().all()  # float8 has no isfinite
        ]
        if bad:
            raise CheckpointError(
                f"{source}: tensors holding NaN or Inf (stored so, or too large for the dtype they load in): "
                f"{_listing(bad)}; the checkpoint is corrupt or was converted wrongly"
            )


def _block_size(config: ModelConfig) -> tuple[int, int]:
    qc = config.quantization_config
    return tuple(qc.weight_block_size) if qc is not None else (128, 128)


def _read_source(
    plan: SourcePlan, name: str, reader: SafetensorsReader, config: ModelConfig, device,
    shard: tensor_parallel.Shard | None = None,
) -> torch.Tensor:
    if shard is not None:
        return _read_source_slices(plan, name, reader, config, device, shard)
    raw = reader.read(name).to(device)
    stored = reader.dtype(name)
    if stored == FP8_DTYPE and "fp8" in plan.quantised:
        scale = reader.read(reader.scale_name(name)).to(device)
        return quant.dequantize_fp8(raw, scale, _block_size(config))
    if stored in FP4_PACKED_DTYPES and "fp4" in plan.quantised:
        return quant.dequantize_fp4(raw, reader.read(reader.scale_name(name)).to(device))
    return raw


def _read_source_slices(
    plan: SourcePlan, name: str, reader: SafetensorsReader, config: ModelConfig, device, shard: tensor_parallel.Shard
) -> torch.Tensor:
    """`_read_source` of only a tensor-parallel rank's slices (`shard` cuts the stored tensor `name`)."""
    stored = reader.dtype(name)
    if stored == FP8_DTYPE and "fp8" in plan.quantised:
        return tensor_parallel.read_fp8_slices(reader, name, shard, _block_size(config), device)
    if stored in FP4_PACKED_DTYPES and "fp4" in plan.quantised:
        codes, scale = _fp4_slices(name, reader, device, shard)
        return quant.dequantize_fp4(codes, scale)
    return tensor_parallel.read_slices(reader, name, shard, device)


def _fp4_slices(name: str, reader: SafetensorsReader, device, shard: tensor_parallel.Shard | None):
    """The packed codes and scales of FP4 tensor `name` (only `shard`'s slices when given)."""
    scale_name = reader.scale_name(name)
    if shard is None:
        return reader.read(name).to(device), reader.read(scale_name).to(device)
    is_input_dim = shard.dim == len(reader.shape(name)) - 1  # cut along the packed, grouped dim
    return (tensor_parallel.read_slices(reader, name, shard, device, 2 if is_input_dim else 1),
            tensor_parallel.read_slices(reader, scale_name, shard, device, quant.FP4_GROUP_SIZE if is_input_dim else 1))


def _build(
    plan: SourcePlan, reader: SafetensorsReader, config: ModelConfig, dtype: torch.dtype, device,
    shard: tensor_parallel.Shard | None = None,
) -> torch.Tensor:
    source_shard = shard.source_shard(plan.join) if shard is not None else None
    parts = [_read_source(plan, source, reader, config, device, source_shard).to(dtype) for source in plan.sources]
    return plan.combine(parts)


def _build_fp4(plan: SourcePlan, reader: SafetensorsReader, device,
               shard: tensor_parallel.Shard | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and e8m0 scales of an FP4 expert tensor, joined like the dense tensor would be."""
    codes, scales = [], []
    source_shard = shard.source_shard(plan.join) if shard is not None else None
    for source in plan.sources:
        if reader.dtype(source) not in FP4_PACKED_DTYPES:
            raise CheckpointError(
                f"{source} is stored as {reader.dtype(source)}, not packed FP4, though "
                f"quantization_config.expert_dtype is 'fp4'; load with quantized_weights='dequantize'"
            )
        code, scale = _fp4_slices(source, reader, device, source_shard)
        codes.append(code.view(torch.int8))
        scales.append(_e8m0_scale(reader.scale_name(source), scale))
    return plan.combine(codes), plan.combine(scales)


def _e8m0_scale(name: str, scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == quant.FP4_SCALE_DTYPE:
        return scale
    as_e8m0 = scale.to(quant.FP4_SCALE_DTYPE)
    if not torch.equal(as_e8m0.float(), scale.float()):
        raise CheckpointError(
            f"{name} ({scale.dtype}) holds FP4 scales that are not powers of two, which the packed experts "
            f"cannot keep; load with quantized_weights='dequantize'"
        )
    return as_e8m0


def _check_tid2eid(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    for name, table in weights.items():
        if (
            name.endswith(".tid2eid")
            and not table.is_floating_point()
            and table.numel()
            and not (0 <= int(table.min()) and int(table.max()) < config.n_routed_experts)
        ):
            raise CheckpointError(
                f"{name} holds expert ids outside [0, {config.n_routed_experts}) "
                f"(min {int(table.min())}, max {int(table.max())}); is n_routed_experts right?"
            )
