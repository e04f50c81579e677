"""Triton layer ops: mHC fused across each block boundary (V4's, and V4.1's single pass: `SinglePassMixing`),
RMSNorm with RoPE, the compressor close.

Per layer a decode step runs two mHC launches (each folds the previous block's output into the
streams, computes the next block's mixing weights with Sinkhorn, collapses and normalises its input),
one launch per RMSNorm (+ RoPE), and two per compressor (window close, ring write). Rows of tables in
pinned host memory (V4.1's host-placed Engram) are read by a kernel (`HostRowGather`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.backends import AttentionMetadata, CompressorWeights, HyperWeights, LayerOpsSpec
from deepinfer_nvidia_sm100 import host_gather_kernels, hyper_kernels, layer_kernels, single_pass


class TritonLayerOps:
    supports_cuda_graphs = True

    def __init__(self, spec: LayerOpsSpec, device: torch.device) -> None:
        self.spec = spec
        self.counters = hyper_kernels.new_split_counters(device)  # split-K arrival counters, self-resetting

    def map_rows(self, fn, *rows):
        return fn(*rows)

    def fp32_linear(self, x, weight):
        if x.device.type != "cuda":  # Triton's interpreter (the CPU tests): a vocabulary-wide head takes ~20 s
            return F.linear(x.float(), weight.float())
        return layer_kernels.fp32_linear(x, weight)

    def gather_host_rows(self, table, ids, out=None):
        return host_gather_kernels.gather_rows(table, ids, out)

    def hc_pre(self, streams, hc: HyperWeights, norm_weight):
        return hyper_kernels.hc_pre(streams, hc, norm_weight, self.spec, counters=self.counters)

    def hc_post_pre(self, streams, block_out, post, comb, hc: HyperWeights, norm_weight):
        return hyper_kernels.hc_post_pre(streams, block_out, post, comb, hc, norm_weight, self.spec,
                                         counters=self.counters)

    def hc_post_head(self, streams, block_out, post, comb, rows, head: HyperWeights, norm_weight):
        return hyper_kernels.hc_post_head(streams, block_out, post, comb, rows, head, norm_weight, self.spec,
                                          counters=self.counters)

    def hc_mix(self, streams, hc: HyperWeights, norm_weight, collapse_pre):
        return single_pass.hc_mix(streams, hc, norm_weight, collapse_pre, self.spec, counters=self.counters)

    def hc_post_mix(self, streams, block_out, post, comb, hc: HyperWeights, norm_weight, collapse_pre):
        return single_pass.hc_post_mix(streams, block_out, post, comb, hc, norm_weight, collapse_pre, self.spec,
                                       counters=self.counters)

    def rms_norm(self, x, weight, cos=None, sin=None):
        return layer_kernels.rms_norm(x, weight, self.spec.rms_norm_eps, cos, sin)

    def rotary(self, x, cos, sin):
        return layer_kernels.rotary(x, cos, sin)

    def write_window(self, metadata: AttentionMetadata, window, kv) -> None:
        layer_kernels.write_ring(metadata, window, kv)

    def compress(self, kv, gate, weights: CompressorWeights, metadata: AttentionMetadata, kv_tail, gate_tail,
                 entries, no_write_before) -> None:
        layer_kernels.compress(kv, gate, weights, metadata, kv_tail, gate_tail, entries, no_write_before,
                               self.spec.rms_norm_eps)
