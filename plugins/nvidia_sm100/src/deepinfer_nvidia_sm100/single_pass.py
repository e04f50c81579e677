"""DeepSeek-V4.1's single-pass mHC boundaries (`SinglePassMixing`) on the V4 boundary kernels.

Each is one launch of `hyper_kernels.hyper_kernel` (two from `TWO_PASS_MIN_ROWS` rows on), the same as
`hc_pre` / `hc_post_pre` but for the collapse, which takes the caller's `collapse_pre` (the previous
site's `pre`; `GIVEN_PRE`), while the `pre` the kernel works out is returned for the next boundary.
"""

from __future__ import annotations

import torch

from deepinfer_core.backends.layer_ops import HyperWeights, LayerOpsSpec
from deepinfer_nvidia_sm100 import hyper_kernels


def hc_mix(streams: torch.Tensor, hc: HyperWeights, norm_weight: torch.Tensor, collapse_pre: torch.Tensor,
           spec: LayerOpsSpec, *, counters: torch.Tensor | None = None,
           plan: hyper_kernels.LaunchPlan | None = None):
    """`SinglePassMixing.hc_mix` (V4.1): `hc_pre`'s launch, the collapse taking `collapse_pre` `[T, n]`;
    returns `pre` (a strided view), `post`, `comb`, `x`. `plan` as in `hyper_kernels.hc_pre`."""
    hyper_kernels._check_streams(streams, spec)
    hyper_kernels._check_weights(hc, spec, is_head=False)
    num_tokens, n, hidden = streams.shape
    post = streams.new_empty((num_tokens, n), dtype=torch.float32)
    comb = streams.new_empty((num_tokens, n, n), dtype=torch.float32)
    x = streams.new_empty((num_tokens, hidden))
    pre = hyper_kernels._launch(streams, None, None, None, None, hc, norm_weight, spec, None, post, comb, x,
                                counters, plan, collapse_pre=collapse_pre.float())
    return pre, post, comb, x


def hc_post_mix(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                hc: HyperWeights, norm_weight: torch.Tensor, collapse_pre: torch.Tensor, spec: LayerOpsSpec, *,
                counters: torch.Tensor | None = None, plan: hyper_kernels.LaunchPlan | None = None):
    """`SinglePassMixing.hc_post_mix` (V4.1): `hc_post_pre`'s launch, the collapse taking `collapse_pre`;
    returns the new streams, then `hc_mix`'s four tensors."""
    hyper_kernels._check_streams(streams, spec)
    hyper_kernels._check_weights(hc, spec, is_head=False)
    num_tokens, n, hidden = streams.shape
    new = streams.new_empty((num_tokens, n, hidden))
    new_post = streams.new_empty((num_tokens, n), dtype=torch.float32)
    new_comb = streams.new_empty((num_tokens, n, n), dtype=torch.float32)
    x = streams.new_empty((num_tokens, hidden))
    pre = hyper_kernels._launch(streams, block_out, post, comb, None, hc, norm_weight, spec, new, new_post,
                                new_comb, x, counters, plan, collapse_pre=collapse_pre.float())
    return new, pre, new_post, new_comb, x
