"""Layer ops on the Ascend 950: RMSNorm through `npu_rms_norm`, RoPE through `npu_rotary_mul`.

The rest runs in PyTorch on the NPU (the reference's code, which reads no device value in decode):

- mHC (`hc_pre`, `hc_post_pre`, `hc_post_head`): torch_npu's `npu_mhc_pre` / `npu_mhc_sinkhorn` /
  `npu_mhc_post` are documented for the 950, but vllm-ascend found the A5 HcPre kernel ignoring its
  mixing weights (vllm-ascend#17122) and `npu_mhc_post`'s h_res transpose convention is unverified;
  they need a hardware comparison before they replace exact PyTorch.
- the compressor and the window write: CANN's `compressor` pools from an fp32 state cache of its own
  layout (`[blocks, block, 2 * coff * D]`), not the engine's tail rings; adopting it needs a core
  cache-format hook.
"""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer_ascend950.constraints import RMS_NORM, check_rotary_call, require
from deepinfer_core.backends.layer_ops import LayerOpsSpec
from deepinfer_core.reference.layer_ops import ReferenceLayerOps


def interleaved_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, 1, R]` cos/sin for `rotary_mode="interleave"` from the contract's `[T, R/2]` tables: each
    angle repeated for its pair `(2i, 2i + 1)`."""
    return cos.repeat_interleave(2, dim=-1)[:, None], sin.repeat_interleave(2, dim=-1)[:, None]


class AscendLayerOps(ReferenceLayerOps):
    """`LayerOps` on the Ascend 950; norms and RoPE on torch_npu ops, the rest inherited PyTorch."""

    supports_cuda_graphs = True

    def __init__(self, spec: LayerOpsSpec, torch_npu: ModuleType) -> None:
        super().__init__(spec)
        self.npu = torch_npu
        self._unit: dict[tuple[int, torch.device], torch.Tensor] = {}
        """Unit gammas of the unweighted norms, per width and device."""

    def rms_norm(self, x, weight, cos=None, sin=None):
        require(x.is_floating_point(), RMS_NORM, "x", f"has dtype {x.dtype}; a floating dtype is needed")
        gamma = weight
        if gamma is None:
            key = (x.shape[-1], x.device)
            gamma = self._unit.get(key)
            if gamma is None:
                gamma = self._unit[key] = torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
        y, _ = self.npu.npu_rms_norm(x, gamma.to(torch.float32), epsilon=self.spec.rms_norm_eps)
        y = y.to(x.dtype)
        return y if cos is None else self.rotary(y, cos, sin)

    def rotary(self, x, cos, sin):
        check_rotary_call(x, cos)
        rope_dim = 2 * cos.shape[-1]
        rope = x[..., -rope_dim:].reshape(x.shape[0], -1, rope_dim).float()  # fp32, as the reference rotates
        r1, r2 = interleaved_tables(cos.float(), sin.float())
        rotated = self.npu.npu_rotary_mul(rope, r1, r2, rotary_mode="interleave").to(x.dtype)
        return torch.cat((x[..., :-rope_dim], rotated.reshape(*x.shape[:-1], rope_dim)), dim=-1)
