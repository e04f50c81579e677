"""Kernel tests need a CUDA device of compute capability >= 9.0; they skip, saying why, elsewhere.

Tests that take `kernel_device` run everywhere: compiled on a suitable GPU, and on the CPU through
Triton's interpreter (`TRITON_INTERPRET=1`, set here before any kernel module is imported; the plugin's
hooks import kernel modules only on a suitable GPU, so nothing else in the process is affected).
"""

from __future__ import annotations

import os

import pytest
import torch
from deepinfer_nvidia_sm100.platform import device_problem

if device_problem() is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def cuda_device() -> torch.device:
    problem = device_problem()
    if problem is not None:
        pytest.skip(f"needs a CUDA device of compute capability >= 9.0 with Triton: {problem}")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def kernel_device() -> torch.device:
    """The GPU when there is a suitable one, else the CPU (kernels then run in Triton's interpreter)."""
    if device_problem() is None:
        return torch.device("cuda", torch.cuda.current_device())
    pytest.importorskip("triton", reason="the kernels' interpreter tests need triton")
    return torch.device("cpu")
