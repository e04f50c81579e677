"""Small building blocks of the V4 model; parameter names follow transformers' checkpoint names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight; normalises and multiplies in fp32, casts once at the end."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """mHC around one block: collapses `hc_mult` residual streams into the block input, and returns the
    `post` (expand) and Sinkhorn-projected `comb` (mix) weights used to fold the block output back in."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.eps = n, sinkhorn_iters, hc_eps, eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`streams` `[T, n, D]` -> (post `[T, n]`, comb `[T, n, n]`, collapsed `[T, D]`)."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.eps)
        mixes = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hyper_residual(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams `[T, n, D]`: `post[j] * out + sum_i comb[i, j] * streams[i]`."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final collapse of the `hc_mult` streams before the output norm."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, eps: float) -> None:
        super().__init__()
        self.hc_eps, self.eps = hc_eps, eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class SharedExpert(nn.Module):
    """The always-on SwiGLU expert, with V4's clamp on the gate (max) and up (both sides)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj(F.silu(gate) * up)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: group g of the input maps to its own `out // groups` outputs."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.zeros(out_features, in_per_group, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[T, groups, in_per_group]` -> `[T, out_features]`."""
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)  # [g, in, out]
        # a plain batched GEMM over groups (an einsum here picked slow fallback kernels on Hopper)
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1)
