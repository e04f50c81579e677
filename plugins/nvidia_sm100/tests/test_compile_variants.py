"""A cold start compiles each tuned kernel once per tile size, not once per batch size.

Triton compiles a kernel again for every new set of constexpr values and for every new specialisation of
an integer argument (equal to 1, a multiple of 16, other) that `do_not_specialize` does not exempt. The
decode CUDA graphs are captured for a ladder of batch sizes, so a launch whose constexprs or specialised
integers follow the batch size costs a compile (0.3-2.5 s each on an H200) per size. These tests record
the launches the launchers make, without running them, at V4-Flash's sizes and an H200's SM count, and
count the variants Triton would build.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import LinearSpec
from deepinfer_core.backends.layer_ops import HyperWeights, LayerOpsSpec


class Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kwargs)` records the variant."""

    def __init__(self, kernel) -> None:
        self.names = kernel.arg_names
        # Triton 3.6 keeps the list on the kernel (empty when none); older releases kept it in `kwargs`
        unspecialised = (getattr(kernel, "do_not_specialize", None)
                         or getattr(kernel, "kwargs", {}).get("do_not_specialize") or ())
        self.unspecialised = {self.names[a] if isinstance(a, int) else a for a in unspecialised}
        self.variants: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.variants.append(self.variant(args, kwargs))
        return launch

    def variant(self, args, kwargs) -> tuple:
        """What Triton keys a compile on: the constexprs (keywords here) and each integer's specialisation."""
        def key(name, value):
            if isinstance(value, torch.Tensor):
                return str(value.dtype)
            if isinstance(value, bool) or not isinstance(value, int) or name in self.unspecialised:
                return type(value).__name__
            return "1" if value == 1 else "16k" if value % 16 == 0 else "int"
        return tuple(sorted(kwargs.items())), tuple(key(n, v) for n, v in zip(self.names, args))


DECODE_ROWS = range(1, 65)


@pytest.mark.parametrize("call", ["hc_pre", "hc_post_pre", "hc_post_head"])
def test_mhc_compiles_once_per_token_block_size(monkeypatch, call):
    from deepinfer_nvidia_sm100 import hyper_kernels

    recorder = Recorder(hyper_kernels.hyper_kernel)
    monkeypatch.setattr(hyper_kernels, "hyper_kernel", recorder)
    monkeypatch.setattr(hyper_kernels, "_target_programs", lambda device: 2 * 132)  # an H200
    n, hidden = 4, 4096
    spec = LayerOpsSpec(hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                        dtype=torch.bfloat16)
    is_head = call == "hc_post_head"
    fn_rows = n if is_head else (2 + n) * n
    hc = HyperWeights(fn=torch.zeros(fn_rows, n * hidden), base=torch.zeros(fn_rows), scale=torch.ones(3))
    norm = torch.ones(hidden, dtype=torch.bfloat16)
    by_block = {}
    for rows in DECODE_ROWS:
        streams = torch.zeros(rows, n, hidden, dtype=torch.bfloat16)
        block_out = torch.zeros(rows, hidden, dtype=torch.bfloat16)
        post, comb = torch.zeros(rows, n), torch.zeros(rows, n, n)
        if call == "hc_pre":
            hyper_kernels.hc_pre(streams, hc, norm, spec)
        elif call == "hc_post_pre":
            hyper_kernels.hc_post_pre(streams, block_out, post, comb, hc, norm, spec)
        else:
            hyper_kernels.hc_post_head(streams, block_out, post, comb, torch.arange(rows), hc, norm, spec)
        plan = hyper_kernels.launch_plan(rows, n, hidden, is_head, torch.device("cpu"))
        by_block.setdefault(plan.block_tokens, set()).add(recorder.variants[-1])
    assert set(by_block) == {1, 16}  # both token-block sizes and several split counts are in the ladder
    assert {block: len(variants) for block, variants in by_block.items()} == {1: 1, 16: 1}


@pytest.mark.parametrize("spec", [
    LinearSpec(in_features=4096, out_features=1024, block=(128, 128), dtype=torch.bfloat16),
    LinearSpec(in_features=4096, out_features=8192, groups=8, block=(128, 128), dtype=torch.bfloat16),
    LinearSpec(in_features=7168, out_features=1536, block=(32, 32), scale_format="ue8m0", dtype=torch.bfloat16),
], ids=["v4", "v4-grouped", "v41"])
def test_fp8_gemm_compiles_once_per_row_tile(monkeypatch, spec):
    from deepinfer_nvidia_sm100 import linear

    recorders = {name: Recorder(getattr(linear, name)) for name in ("fp8_gemm_kernel", "split_k_sum_kernel")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(linear, name, recorder)
    backend = linear.TritonFP8Linear(spec, num_sms=132)
    monkeypatch.setattr(backend, "quantize", lambda x: (
        torch.zeros(x.shape, dtype=torch.float8_e4m3fn), torch.zeros(x.shape[0], -(-x.shape[1] // 128))))
    weight = torch.zeros(spec.out_features, spec.in_features, dtype=torch.float8_e4m3fn)
    scale = torch.ones(-(-spec.out_features // spec.block[0]), -(-spec.in_features // spec.block[1]))
    tile_sizes = set()
    for tokens in DECODE_ROWS:
        backend.forward(torch.zeros(tokens, spec.in_features, dtype=torch.bfloat16), weight, scale)
        tile_sizes.add(linear.pick_tiles(tokens, spec, 132).block_m)
    assert tile_sizes == {16, 32, 64}
    assert len(set(recorders["fp8_gemm_kernel"].variants)) == len(tile_sizes)
    assert len(set(recorders["split_k_sum_kernel"].variants)) <= len(tile_sizes)
