"""What this machine offers: torch_npu with an Ascend 950 NPU, and CANN's `cann_ops_transformer`.

Nothing here imports torch_npu or cann_ops_transformer at module import: the loaders import them on
first call (after `ASCEND_RT_VISIBLE_DEVICES` is set, as vllm-ascend does), cache the module, and
raise `AscendUnavailableError` with the reason. Each `*_problem` function returns None when satisfied,
else the reason a hook gives to `decline`.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

ASCEND_950_SOC_VERSION = 260
"""`torch_npu.npu.get_soc_version()` of an Ascend 950 (vllm-ascend's `device/hardware.py` maps 260 to A5)."""
REQUIRED = "CANN 9.2 with torch-npu 2.14 and its cann_ops_transformer extension"


class AscendUnavailableError(RuntimeError):
    """torch_npu, an NPU or cann_ops_transformer is missing; the message says which and how to fix it."""


@functools.cache
def load_torch_npu() -> ModuleType:
    """`torch_npu`, imported once (it registers the `npu` device with torch).

    :raises AscendUnavailableError: it is not installed or fails to import (it needs the CANN toolkit).
    """
    try:
        return importlib.import_module("torch_npu")
    except Exception as err:
        raise AscendUnavailableError(f"torch_npu is not importable ({type(err).__name__}: {err}); "
                                     f"install {REQUIRED}") from err


@functools.cache
def load_cann_ops() -> ModuleType:
    """CANN ops-transformer's torch extension (`sparse_flash_mla` and friends), imported once.

    :raises AscendUnavailableError: it is not importable.
    """
    try:
        return importlib.import_module("cann_ops_transformer")
    except Exception as err:
        raise AscendUnavailableError(f"cann_ops_transformer not importable ({type(err).__name__}: {err}); "
                                     "it ships with CANN 9.2's ops-transformer (build.sh --torch_extension)") from err


def npu_problem(device: torch.device | None = None) -> str | None:
    """Why `device` (default: the NPU this process would use) is not an Ascend 950, or None."""
    if device is not None and device.type != "npu":
        return f"device {device} is not an NPU"
    try:
        torch_npu = load_torch_npu()
    except AscendUnavailableError as err:
        return str(err)
    if not torch_npu.npu.is_available():
        return "torch_npu found no NPU on this machine (torch_npu.npu.is_available() is False)"
    soc = torch_npu.npu.get_soc_version()
    if soc != ASCEND_950_SOC_VERSION:
        return (f"this plugin targets the Ascend 950 (SoC version {ASCEND_950_SOC_VERSION}); this NPU reports "
                f"{soc} (910B/910C are 220-225/250-255)")
    return None


def cann_problem() -> str | None:
    """Why `cann_ops_transformer` cannot be used, or None."""
    try:
        load_cann_ops()
    except AscendUnavailableError as err:
        return str(err)
    return None


def npu_memory_counters(device: torch.device):
    """torch_npu's allocator counters for `device` (`deepinfer_core.backends.MemoryCounters`), with which
    start-up measures the largest step's peak, read through the lazily imported `torch_npu.npu`.

    :raises AttributeError: this torch_npu lacks one of the counters, naming it.
    """
    from deepinfer_core.backends import MemoryCounters

    npu = load_torch_npu().npu
    names = ("mem_get_info", "memory_allocated", "memory_reserved", "max_memory_allocated",
             "reset_peak_memory_stats", "synchronize", "empty_cache")
    missing = [name for name in names if not hasattr(npu, name)]
    if missing:
        raise AttributeError(f"torch_npu.npu has no {', '.join(missing)}: the memory profile needs torch-npu 2.14")
    return MemoryCounters(
        mem_get_info=lambda: npu.mem_get_info(device),
        allocated=lambda: npu.memory_allocated(device),
        reserved=lambda: npu.memory_reserved(device),
        peak_allocated=lambda: npu.max_memory_allocated(device),
        reset_peak=lambda: npu.reset_peak_memory_stats(device),
        synchronize=lambda: npu.synchronize(device),
        empty_cache=npu.empty_cache,
    )
