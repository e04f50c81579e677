"""Checkpoint loading: safetensors (single file or sharded), both layouts, FP8/FP4 dequantisation.

Which tensors exist, their shapes and their on-disk names come from `checkpoint_layout`; this module
reads the files, checks every tensor before loading any, dequantises and joins. Quantised tensors are
recognised by dtype: float8_e4m3fn with a block scale (`<name>.scale` or `<name>.weight_scale_inv`), and,
when `quantization_config.expert_dtype == "fp4"`, int8/uint8 packed e2m1 with per-32 scales (`quant.py`).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from deepinfer_core.config import ModelConfig
from deepinfer_core.models import quant
from deepinfer_core.models.checkpoint_layout import (
    IGNORED_PREFIXES,
    CheckpointError,
    SourcePlan,
    detect_layout,
    expected_tensors,
    is_fp32_tensor,
    is_integer_tensor,
    source_plans,
)

__all__ = ["CheckpointError", "checkpoint_files", "expected_tensors", "load_weights"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_AUTO_PROGRESS_BYTES = 512 * 2**20


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to its safetensors file."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path} has no 'weight_map' object")
        files = {name: model_dir / file for name, file in weight_map.items()}
        absent = sorted({str(path) for path in files.values() if not path.is_file()})
        if absent:
            raise CheckpointError(f"{index_path} names shard files that do not exist: {absent}")
        return files
    paths = (
        [model_dir / SINGLE_FILE]
        if (model_dir / SINGLE_FILE).is_file()
        else sorted(model_dir.glob("*.safetensors"))
    )
    if not paths:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    files = {}
    for path in paths:
        with safe_open(path, framework="pt") as handle:
            files |= dict.fromkeys(handle.keys(), path)
    return files


_FP8 = "F8_E4M3"
_PACKED = ("I8", "U8")


class _Reader:
    """Open safetensors handles plus per-tensor metadata, read lazily."""

    def __init__(self, files: dict[str, Path], stack: ExitStack) -> None:
        handles = {path: stack.enter_context(safe_open(path, framework="pt")) for path in set(files.values())}
        self._handles = {name: handles[path] for name, path in files.items()}
        self.names = set(files)

    def dtype(self, name: str) -> str:
        return self._handles[name].get_slice(name).get_dtype()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        return self._handles[name].get_tensor(name)

    def scale_name(self, name: str) -> str | None:
        base = name.removesuffix(".weight")
        candidates = (base + ".scale", name + "_scale_inv", name + ".scale")
        return next((c for c in candidates if c in self.names), None)


@dataclass
class _Problems:
    missing: list[str]
    unexpected: list[str]
    misshaped: list[str]

    def raise_if_any(self, layout: str) -> None:
        sections = []
        if self.missing:
            sections.append(f"missing tensors: {_listing(self.missing)}")
        if self.unexpected:
            sections.append(f"unexpected tensors (for the {layout!r} layout): {_listing(self.unexpected)}")
        if self.misshaped:
            sections.append(f"misshaped tensors: {_listing(self.misshaped)}")
        if sections:
            raise CheckpointError("checkpoint does not match config.json; " + "; ".join(sections))


def _listing(items: list[str], limit: int = 20) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def load_weights(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    progress: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Load a checkpoint into internal names, dequantised, on `device`.

    Floating tensors come back in `dtype`, except those `is_fp32_tensor` names (kept float32) and
    `tid2eid` (int64). Every tensor is checked against `expected_tensors(config)` before any is read;
    any missing, unexpected or misshaped tensor raises `CheckpointError` naming all of them.
    `progress` shows a bar (None: only for checkpoints over 512 MiB).
    """
    files = checkpoint_files(model_dir)
    layout = detect_layout(list(files))
    plans = source_plans(config, layout)
    if config.tie_word_embeddings and plans["lm_head.weight"].sources[0] not in files:
        plans["lm_head.weight"] = plans["model.embed_tokens.weight"]
    if progress is None:
        progress = sum(path.stat().st_size for path in set(files.values())) > _AUTO_PROGRESS_BYTES
    with ExitStack() as stack:
        reader = _Reader(files, stack)
        _check(plans, reader, config).raise_if_any(layout)
        bar = tqdm(plans.items(), desc="Loading weights", unit="tensor", disable=not progress)
        weights = {
            name: _build(plan, reader, config, _target_dtype(name, dtype), device) for name, plan in bar
        }
    _check_tid2eid(weights, config)
    return weights


def _target_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    if is_integer_tensor(name):
        return torch.int64
    return torch.float32 if is_fp32_tensor(name) else dtype


def _check(plans: dict[str, SourcePlan], reader: _Reader, config: ModelConfig) -> _Problems:
    problems = _Problems([], [], [])
    consumed = set()
    block = _block_size(config)
    for plan in plans.values():
        for source in plan.sources:
            if source not in reader.names:
                problems.missing.append(source)
                continue
            consumed.add(source)
            stored = reader.dtype(source)
            expected = {source: plan.source_shape}
            if stored == _FP8 or (stored in _PACKED and not is_integer_tensor(plan.target)):
                scale = reader.scale_name(source)
                if scale is None:
                    problems.missing.append(f"{source.removesuffix('.weight')}.scale (quantisation scale)")
                    continue
                consumed.add(scale)
                if stored == _FP8:
                    expected[scale] = quant.fp8_scale_shape(plan.source_shape, block)
                elif config.expert_dtype != "fp4":
                    problems.misshaped.append(
                        f"{source} is packed FP4 ({stored}) but quantization_config.expert_dtype is not 'fp4'"
                    )
                    continue
                else:
                    expected[source] = quant.fp4_packed_shape(plan.source_shape)
                    expected[scale] = quant.fp4_scale_shape(plan.source_shape)
            for name, shape in expected.items():
                if reader.shape(name) != tuple(shape):
                    problems.misshaped.append(
                        f"{name} has shape {list(reader.shape(name))}, expected {list(shape)}"
                    )
    problems.unexpected = sorted(n for n in reader.names - consumed if not n.startswith(IGNORED_PREFIXES))
    return problems


def _block_size(config: ModelConfig) -> tuple[int, int]:
    qc = config.quantization_config
    return tuple(qc.weight_block_size) if qc is not None else (128, 128)


def _read_source(name: str, reader: _Reader, config: ModelConfig, device) -> torch.Tensor:
    raw = reader.read(name).to(device)
    stored = reader.dtype(name)
    if stored == _FP8:
        scale = reader.read(reader.scale_name(name)).to(device)
        return quant.dequantize_fp8(raw, scale, _block_size(config))
    if stored in _PACKED and reader.scale_name(name) is not None:
        return quant.dequantize_fp4(raw, reader.read(reader.scale_name(name)).to(device))
    return raw


def _build(
    plan: SourcePlan, reader: _Reader, config: ModelConfig, dtype: torch.dtype, device
) -> torch.Tensor:
    return plan.combine([_read_source(source, reader, config, device).to(dtype) for source in plan.sources])


def _check_tid2eid(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    for name, table in weights.items():
        if (
            is_integer_tensor(name)
            and table.numel()
            and not (0 <= int(table.min()) and int(table.max()) < config.n_routed_experts)
        ):
            raise CheckpointError(
                f"{name} holds expert ids outside [0, {config.n_routed_experts}) "
                f"(min {int(table.min())}, max {int(table.max())}); is n_routed_experts right?"
            )
