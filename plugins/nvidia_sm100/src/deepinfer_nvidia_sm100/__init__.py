"""DeepInfer plugin for NVIDIA GPUs of compute capability 9.0+ (Hopper, Blackwell): Triton kernels.

The hooks live in `deepinfer_nvidia_sm100.hooks` (entry point `nvidia_sm100` in group `deepinfer`).
Kernel modules import Triton, so they are imported only after a suitable GPU was found.
"""

__version__ = "0.2.0"
