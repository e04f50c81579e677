"""The conformance suite passes the reference and catches backends that break the contracts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_core.backends import AttentionSpec, LayerOpsSpec, MoESpec, SamplerOutput, SamplingSpec
from deepinfer_core.reference.attention import ReferenceAttention
from deepinfer_core.reference.layer_ops import ReferenceLayerOps
from deepinfer_core.reference.moe import ReferenceMoE
from deepinfer_core.reference.sampling import ReferenceSampler
from deepinfer_core.testing import conformance

CPU = torch.device("cpu")
SLIDING = AttentionSpec(num_heads=4, head_dim=16, sliding_window=8, compress_rate=0)
CSA = AttentionSpec(num_heads=4, head_dim=16, sliding_window=8, compress_rate=4, index_n_heads=2,
                    index_head_dim=8, index_topk=4)
HCA = AttentionSpec(num_heads=4, head_dim=16, sliding_window=8, compress_rate=16)
TOPK_MOE = MoESpec(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2, scoring_func="sqrtsoftplus",
                   routed_scaling_factor=1.5, swiglu_limit=10.0)


@pytest.mark.parametrize("spec", [SLIDING, CSA, HCA], ids=["sliding", "csa", "hca"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_attention_conforms(spec, dtype):
    conformance.check_attention(ReferenceAttention(spec, CPU), CPU, dtype=dtype)


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("is_hash", [False, True])
def test_reference_moe_conforms(scoring_func, is_hash):
    spec = dataclasses.replace(TOPK_MOE, scoring_func=scoring_func, is_hash=is_hash)
    conformance.check_moe(ReferenceMoE(spec, CPU), CPU)
    conformance.check_moe(ReferenceMoE(spec, CPU), CPU, dtype=torch.bfloat16)


def test_moe_with_more_experts_than_hidden_width_conforms():
    spec = dataclasses.replace(TOPK_MOE, hidden_size=8, num_experts=16)
    conformance.check_moe(ReferenceMoE(spec, CPU), CPU)


def test_reference_sampler_conforms():
    conformance.check_sampler(ReferenceSampler(SamplingSpec(vocab_size=64), CPU), CPU)


# ------------------------------------------------------------------------------------------------ mutants


class AttentionWithoutSinks(ReferenceAttention):
    def forward(self, q, kv, window, compressed, sinks, *args, **kwargs):
        return super().forward(q, kv, window, compressed, torch.full_like(sinks, -torch.inf), *args, **kwargs)


class AttentionReadingOneEntryTooMany(ReferenceAttention):
    def forward(self, q, kv, window, compressed, sinks, metadata, topk_indices=None, num_entries=None):
        return super().forward(q, kv, window, compressed, sinks, metadata, topk_indices, num_entries + 1)


class IndexerPickingTheWorst(ReferenceAttention):
    def indexer_topk(self, q, weights, index_keys, metadata, num_entries):
        return super().indexer_topk(-q, weights, index_keys, metadata, num_entries)


class MoEIgnoringBias(ReferenceMoE):
    def forward(self, x, input_ids, weights):
        return super().forward(x, input_ids, dataclasses.replace(weights, score_bias=None))


class MoEWithoutClamp(ReferenceMoE):
    def forward(self, x, input_ids, weights):
        unclamped = ReferenceMoE(dataclasses.replace(self.spec, swiglu_limit=0.0), self.device)
        return unclamped.forward(x, input_ids, weights)


class SamplerWithTemperedLogprobs(ReferenceSampler):
    def sample(self, logits, params):
        output = super().sample(logits, params)
        scale = torch.where(params.temperature > 0, params.temperature, 1.0)
        tempered = torch.log_softmax(logits / scale[:, None], dim=-1)
        return dataclasses.replace(output, logprobs=tempered.gather(1, output.token_ids[:, None]).squeeze(1))


class SamplerIgnoringBans(ReferenceSampler):
    def sample(self, logits, params):
        return super().sample(logits, dataclasses.replace(params, banned_token_ids=None))


class SamplerDependingOnBatchOrder(ReferenceSampler):
    def sample(self, logits, params) -> SamplerOutput:
        steps = params.steps + torch.arange(len(params.steps))
        return super().sample(logits, dataclasses.replace(params, steps=steps))


@pytest.mark.parametrize(("backend", "message"), [
    (AttentionWithoutSinks(HCA, CPU), "attention forward"),
    (AttentionReadingOneEntryTooMany(HCA, CPU), "NaN in the output"),
    (IndexerPickingTheWorst(CSA, CPU), "picked lower-scoring entries"),
])
def test_broken_attention_fails(backend, message):
    with pytest.raises(AssertionError, match=message):
        conformance.check_attention(backend, CPU)


@pytest.mark.parametrize(("backend", "message"), [
    (MoEIgnoringBias(TOPK_MOE, CPU), "score bias decides"),
    (MoEWithoutClamp(TOPK_MOE, CPU), "moe forward"),
])
def test_broken_moe_fails(backend, message):
    with pytest.raises(AssertionError, match=message):
        conformance.check_moe(backend, CPU)


@pytest.mark.parametrize(("backend", "message"), [
    (SamplerWithTemperedLogprobs(SamplingSpec(vocab_size=64), CPU), "logprobs of the chosen tokens"),
    (SamplerIgnoringBans(SamplingSpec(vocab_size=64), CPU), "greedy rows chose"),
    (SamplerDependingOnBatchOrder(SamplingSpec(vocab_size=64), CPU), "depend on the batch order"),
])
def test_broken_sampler_fails(backend, message):
    with pytest.raises(AssertionError, match=message):
        conformance.check_sampler(backend, CPU)


# ------------------------------------------------------------------------------------------------ layer ops

LAYER_OPS = LayerOpsSpec(hidden_size=32, hc_mult=3, hc_sinkhorn_iters=5, hc_eps=1e-6, rms_norm_eps=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hc_mult", [1, 4])
def test_reference_layer_ops_conform(dtype, hc_mult):
    spec = dataclasses.replace(LAYER_OPS, hc_mult=hc_mult, dtype=dtype)
    conformance.check_layer_ops(ReferenceLayerOps(spec), CPU)


class LayerOpsWithFewerSinkhornSteps(ReferenceLayerOps):
    def hc_pre(self, streams, hc, norm_weight):
        return ReferenceLayerOps(dataclasses.replace(self.spec, hc_sinkhorn_iters=2)).hc_pre(streams, hc, norm_weight)


class LayerOpsRotatingTheWrongWay(ReferenceLayerOps):
    def rms_norm(self, x, weight, cos=None, sin=None):
        return super().rms_norm(x, weight, cos, None if sin is None else -sin)


class LayerOpsRewritingCachedEntries(ReferenceLayerOps):
    def compress(self, kv, gate, weights, metadata, kv_tail, gate_tail, entries, no_write_before):
        super().compress(kv, gate, weights, metadata, kv_tail, gate_tail, entries, torch.zeros_like(no_write_before))


class LayerOpsSkippingTheRings(ReferenceLayerOps):
    def compress(self, kv, gate, weights, metadata, kv_tail, gate_tail, entries, no_write_before):
        gate = gate.float() + weights.position_bias[metadata.positions % weights.rate]
        self._close_windows(kv, gate, weights, metadata, kv_tail, gate_tail, entries, no_write_before)


@pytest.mark.parametrize(("backend", "message"), [
    (LayerOpsWithFewerSinkhornSteps(LAYER_OPS), "hc_pre: comb"),
    (LayerOpsRotatingTheWrongWay(LAYER_OPS), "rms_norm"),
    (LayerOpsRewritingCachedEntries(LAYER_OPS), "entries"),
    (LayerOpsSkippingTheRings(LAYER_OPS), "kv tail"),
])
def test_broken_layer_ops_fail(backend, message):
    with pytest.raises(AssertionError, match=message):
        conformance.check_layer_ops(backend, CPU)


class LayerOpsWritingEveryWindowRow(ReferenceLayerOps):
    def write_window(self, metadata, window, kv):
        slots = metadata.slots.repeat_interleave(metadata.query_start_loc.diff())
        # every row, the earliest last: where two tokens share a ring row the earlier one stays
        window[slots.flip(0), metadata.positions.flip(0) % window.shape[1]] = kv.flip(0)


def test_window_writes_keep_only_each_requests_last_rows():
    with pytest.raises(AssertionError, match="write_window"):
        conformance.check_layer_ops(LayerOpsWritingEveryWindowRow(LAYER_OPS), CPU)
