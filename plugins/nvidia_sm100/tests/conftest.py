"""Kernel tests need a CUDA device of compute capability >= 9.0; they skip, saying why, elsewhere."""

from __future__ import annotations

import pytest
import torch
from deepinfer_nvidia_sm100.platform import device_problem


@pytest.fixture
def cuda_device() -> torch.device:
    problem = device_problem()
    if problem is not None:
        pytest.skip(f"needs a CUDA device of compute capability >= 9.0 with Triton: {problem}")
    return torch.device("cuda", torch.cuda.current_device())
