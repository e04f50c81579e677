"""What this machine offers: a CUDA device of compute capability >= 9.0, Triton, a supported dtype.

Each check returns `None` when satisfied, else the reason a hook gives to `decline`.
"""

from __future__ import annotations

import importlib.util

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
        return "triton not importable (pip install 'deepinfer-nvidia-sm100[triton]')"
    return None


def dtype_problem(dtype: torch.dtype) -> str | None:
    """Why the kernels cannot run in `dtype`, or None."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        return f"dtype {dtype} not supported (supported: {names})"
    return None
