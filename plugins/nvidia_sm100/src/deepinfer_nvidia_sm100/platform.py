"""What this machine offers: a CUDA device of compute capability >= 9.0, Triton, a supported dtype.

Each check returns `None` when satisfied, else the reason a hook gives to `decline`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

MIN_CAPABILITY = (9, 0)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def device_problem(device: torch.device | None = None) -> str | None:
    """Why `device` (default: the current CUDA device) cannot run these kernels, or None."""
    if device is not None and device.type != "cuda":
        return f"device {device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < MIN_CAPABILITY:
        return f"compute capability {major}.{minor} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    if importlib.util.find_spec("triton") is None:
        return 'triton not importable (pip install "triton>=3.2", the plugin\'s triton extra)'
    return None


def dtype_problem(dtype: torch.dtype) -> str | None:
    """Why the kernels cannot run in `dtype`, or None."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        return f"dtype {dtype} not supported (supported: {names})"
    return None



def cuda_memory_counters(device: torch.device):
    """torch.cuda's allocator counters for `device` (`deepinfer_core.backends.MemoryCounters`), with
    which start-up measures the largest step's peak; None (with the reason) when it is no CUDA device."""
    from deepinfer_core.backends import MemoryCounters

    if device.type != "cuda" or not torch.cuda.is_available():
        return None, f"device {device} is not a CUDA device"
    return MemoryCounters(
        mem_get_info=lambda: torch.cuda.mem_get_info(device),
        allocated=lambda: torch.cuda.memory_allocated(device),
        reserved=lambda: torch.cuda.memory_reserved(device),
        peak_allocated=lambda: torch.cuda.max_memory_allocated(device),
        reset_peak=lambda: torch.cuda.reset_peak_memory_stats(device),
        synchronize=lambda: torch.cuda.synchronize(device),
        empty_cache=torch.cuda.empty_cache,
    ), None


FP8_ACT_GROUP = 128
"""Activation inputs per quantisation scale of the FP8 GEMM (DeepSeek's per-token-group size)."""


def linear_problem(spec) -> str | None:
    """Why the FP8 GEMM cannot run `spec` (a `LinearSpec`), or None."""
    if spec.weight_format != "fp8":
        return f"weight_format {spec.weight_format!r}: dense projections run as torch matmuls"
    rows, cols = spec.block
    if cols not in (32, 64, 128) or rows % 16:
        return f"FP8 scale tile {spec.block} not supported (columns 32, 64 or 128; rows a multiple of 16)"
    if spec.groups > 1 and (spec.in_features % FP8_ACT_GROUP or (spec.out_features // spec.groups) % 16):
        return (f"grouped FP8 projection needs {FP8_ACT_GROUP}-aligned group inputs and 16-aligned group "
                f"outputs, got {spec}")
    if spec.in_features % 16:
        return f"in_features {spec.in_features} is not a multiple of 16"
    return None


def use_kernel_cache() -> Path:
    """Point Triton's on-disk cache of compiled kernels at DeepInfer's cache directory unless the user
    chose one (`TRITON_CACHE_DIR`); return the directory. Default: `$XDG_CACHE_HOME/deepinfer/triton`,
    else `~/.cache/deepinfer/triton`. A warm cache skips every kernel compile at start-up; delete the
    directory to start cold."""
    chosen = os.environ.get("TRITON_CACHE_DIR")
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    directory = Path(base) / "deepinfer" / "triton"
    os.environ["TRITON_CACHE_DIR"] = str(directory)
    return directory
