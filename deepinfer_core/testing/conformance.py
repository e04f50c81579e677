"""Backend conformance suite: a candidate backend must agree with the reference on random inputs.

A plugin calls these from its own tests, on its hardware:

    from deepinfer_core.testing import conformance
    conformance.check_attention(MyAttention(spec, device), device)
    conformance.check_layer_ops(MyLayerOps(spec), device)

Each check builds inputs with `deepinfer_core.testing.cases` (caches poisoned with NaN outside what a
query may read), runs the candidate on `device` in `dtype` and the reference on the CPU in fp32 on the
same (dtype-rounded) values, and raises `AssertionError` describing the first disagreement.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from deepinfer_core.backends import (
    AttentionBackend,
    LinearBackend,
    MoEBackend,
    MoEWeights,
    SamplingBackend,
    SamplingTensors,
)
from deepinfer_core.testing.cases import (
    AttentionCase,
    index_scores,
    random_attention_case,
    random_moe_case,
    random_sampling_case,
    round_to,
)
from deepinfer_core.testing.compare import TOLERANCES, assert_close, tolerances
from deepinfer_core.testing.layer_ops_conformance import check_layer_ops

__all__ = [
    "TOLERANCES", "check_attention", "check_indexer_selection", "check_layer_ops", "check_linear", "check_moe",
    "check_sampler", "fp4_moe_weights", "fp8_linear_case", "tolerances",
]

CPU = torch.device("cpu")

# ---------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------


def attention_scenarios(spec: Any) -> dict[str, tuple[list[int], list[int]]]:
    """Named `(query_lens, start_positions)` batches: prefill, decode, chunked prefill, long context."""
    width, rate = spec.sliding_window, max(spec.compress_rate, 1)
    scenarios = {
        "prefill": ([1, 7, width + 2 * rate + 3], [0, 0, 0]),
        "decode": ([1, 1, 1, 1], [3, width - 1, width + 5, 4 * max(width, rate) + 5]),
        "chunked_prefill": ([1, 33, 5], [2 * width + 7, 3 * max(width, rate) + 1, 2 * rate + 1]),
    }
    if spec.is_sparse:  # enough entries that the indexer's top-k really selects
        scenarios["long_context"] = ([1, 3], [rate * spec.index_topk + 37, rate * (spec.index_topk + 5)])
    return scenarios


def _reference_attention(spec: Any) -> AttentionBackend:
    from deepinfer_core.reference.attention import ReferenceAttention

    return ReferenceAttention(dataclasses.replace(spec, dtype=torch.float32), CPU)


def check_attention(backend: AttentionBackend, device: torch.device, dtype: torch.dtype | None = None,
                    atol: float | None = None, rtol: float | None = None, seed: int = 0) -> None:
    """Check `forward` (and `indexer_topk` for CSA specs) against the reference on every scenario."""
    spec = backend.spec
    dtype = dtype or spec.dtype
    atol, rtol = tolerances(dtype, atol, rtol)
    reference = _reference_attention(spec)
    for name, (query_lens, start_positions) in attention_scenarios(spec).items():
        case = random_attention_case(spec, query_lens, start_positions, seed=seed)
        candidate_case = case.to(device, dtype)
        reference_case = _rounded_case(case, dtype)
        actual = backend.forward(candidate_case.q, candidate_case.kv, candidate_case.window,
                                 candidate_case.compressed, candidate_case.sinks, candidate_case.metadata,
                                 candidate_case.topk_indices, candidate_case.num_entries)
        expected = reference.forward(reference_case.q, reference_case.kv, reference_case.window,
                                     reference_case.compressed, reference_case.sinks, reference_case.metadata,
                                     reference_case.topk_indices, reference_case.num_entries)
        assert_close(actual, expected, atol, rtol, f"attention forward, {name}, {spec}")
        if spec.is_sparse:
            check_indexer_selection(backend, candidate_case, reference_case, atol, rtol, name)


def _rounded_case(case: AttentionCase, dtype: torch.dtype) -> AttentionCase:
    fields = {field.name: round_to(getattr(case, field.name), dtype)
              for field in dataclasses.fields(case) if field.name not in ("metadata", "sinks", "index_weights")}
    return dataclasses.replace(case, **fields)


def check_indexer_selection(backend: AttentionBackend, candidate_case: AttentionCase,
                            reference_case: AttentionCase, atol: float, rtol: float, name: str) -> None:
    """The candidate's top-k entries must be valid and score as high as the true top-k (ties allowed)."""
    spec = backend.spec
    chosen = backend.indexer_topk(candidate_case.index_q, candidate_case.index_weights,
                                  candidate_case.index_keys, candidate_case.metadata,
                                  candidate_case.num_entries).cpu()
    what = f"indexer_topk, {name}, {spec}"
    if chosen.shape != (len(reference_case.metadata.positions), spec.index_topk) or chosen.dtype != torch.int64:
        raise AssertionError(f"{what}: got {chosen.dtype} {list(chosen.shape)}, "
                             f"expected int64 [num_tokens, {spec.index_topk}]")
    scores = index_scores(reference_case, spec)
    for t, position in enumerate(reference_case.metadata.positions.tolist()):
        num_visible = (position + 1) // spec.compress_rate
        expected_count = min(num_visible, spec.index_topk)
        picked = chosen[t][chosen[t] >= 0]
        if len(picked) != expected_count or len(set(picked.tolist())) != expected_count:
            raise AssertionError(f"{what}: token {t} picked {picked.tolist()}, expected {expected_count} "
                                 f"distinct entries of {num_visible} visible")
        if expected_count and int(picked.max()) >= num_visible:
            raise AssertionError(f"{what}: token {t} picked entry {int(picked.max())}, only {num_visible} visible")
        best = scores[t].topk(expected_count).values
        got = scores[t, picked].sort(descending=True).values
        torch.testing.assert_close(got, best, atol=atol, rtol=rtol,
                                   msg=lambda m, t=t: f"{what}: token {t} picked lower-scoring entries: {m}")


# ---------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------


def check_moe(backend: MoEBackend, device: torch.device, dtype: torch.dtype | None = None,
              atol: float | None = None, rtol: float | None = None, seed: int = 0,
              num_tokens_list: tuple[int, ...] = (1, 7, 33)) -> None:
    """Check `forward` against the reference for several token counts (decode-sized and prefill-sized),
    and, for top-k layers, once more with selection decided by `score_bias`. For FP4 experts
    (`spec.expert_format == "fp4"`) both get the same packed weights (`fp4_moe_weights`); the reference
    dequantises them."""
    from deepinfer_core.reference.moe import ReferenceMoE

    spec = backend.spec
    dtype = dtype or spec.dtype
    atol, rtol = tolerances(dtype, atol, rtol)
    reference = ReferenceMoE(dataclasses.replace(spec, dtype=torch.float32), CPU)
    cases = [(n, False) for n in num_tokens_list] + ([] if spec.is_hash else [(num_tokens_list[-1], True)])
    for num_tokens, bias_decides in cases:
        x, input_ids, weights = random_moe_case(spec, num_tokens, seed=seed + num_tokens,
                                                bias_decides=bias_decides)
        if spec.expert_format == "fp4":
            weights = fp4_moe_weights(weights)
        candidate_weights = dataclasses.replace(weights, **{
            f.name: _to(getattr(weights, f.name), device, dtype) for f in dataclasses.fields(weights)})
        reference_weights = dataclasses.replace(weights, **{
            f.name: _reference_tensor(getattr(weights, f.name), dtype) for f in dataclasses.fields(weights)})
        actual = backend.forward(x.to(device=device, dtype=dtype), input_ids.to(device), candidate_weights)
        if actual.dtype != dtype:
            raise AssertionError(f"moe forward returned {actual.dtype}, expected the input's {dtype}")
        expected = reference.forward(round_to(x, dtype), input_ids, reference_weights)
        routing = "score bias decides" if bias_decides else "scores decide"
        assert_close(actual, expected, atol, rtol, f"moe forward, {num_tokens} tokens, {routing}, {spec}")


def fp4_moe_weights(weights: MoEWeights) -> MoEWeights:
    """`weights` with the routed experts quantised to packed FP4 with e8m0 scales (`quant.quantize_fp4`)."""
    from deepinfer_core.backends import quant

    gate_up, gate_up_scale = quant.quantize_fp4(weights.gate_up)
    down, down_scale = quant.quantize_fp4(weights.down)
    return dataclasses.replace(weights, gate_up=gate_up, down=down, gate_up_scale=gate_up_scale,
                               down_scale=down_scale)


def _keeps_dtype(tensor: torch.Tensor) -> bool:
    """Index tables, packed FP4 codes, their e8m0 scales and the fp32 score bias keep their dtype."""
    return not tensor.is_floating_point() or tensor.dim() == 1 or tensor.dtype == torch.float8_e8m0fnu


def _to(tensor: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """Weights to the candidate, in `dtype` unless `_keeps_dtype`."""
    if tensor is None:
        return None
    if _keeps_dtype(tensor):
        return tensor.to(device)
    return tensor.to(device=device, dtype=dtype)


def _reference_tensor(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if tensor is None or _keeps_dtype(tensor):
        return tensor
    return round_to(tensor, dtype)


# ---------------------------------------------------------------------------------------------------
# Linear (FP8 projections)
# ---------------------------------------------------------------------------------------------------

FP8_ACTIVATION_ERROR = 2.0**-4
"""Largest relative rounding of an activation quantised to e4m3 (half its 3-bit mantissa's ulp)."""


def fp8_linear_case(spec: Any, num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(x, weight, scale)` for `spec`: a random weight (std 0.05) quantised to FP8 with `spec.block` tiles
    (power-of-two scales for "ue8m0"), and random fp32 activations of the spec's input shape."""
    from deepinfer_core.backends import quant

    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(spec.out_features, spec.in_features, generator=gen) * 0.05
    scale_dtype = torch.float8_e8m0fnu if spec.scale_format == "ue8m0" else torch.float32
    weight, scale = quant.quantize_fp8(dense, spec.block, scale_dtype)
    shape = (num_tokens, spec.in_features) if spec.groups == 1 else (num_tokens, spec.groups, spec.in_features)
    return torch.randn(shape, generator=gen), weight, scale.float()


def check_linear(backend: LinearBackend, device: torch.device, dtype: torch.dtype | None = None, seed: int = 0,
                 num_tokens_list: tuple[int, ...] = (1, 7, 33)) -> None:
    """Check `forward` against the reference (the dequantised weight, activations as given) for several
    token counts, within the format's tolerance: a backend may quantise each activation to e4m3
    (relative error <= `FP8_ACTIVATION_ERROR`, plus half the subnormal step below 2^-6 of its group's
    scale), so `|actual - expected| <= 2^-4 |x| @ |W|.T + subnormal slack + the dtype's tolerance`."""
    from deepinfer_core.reference.linear import ReferenceLinear

    spec = backend.spec
    dtype = dtype or spec.dtype
    atol, rtol = tolerances(dtype)
    reference = ReferenceLinear(dataclasses.replace(spec, dtype=torch.float32), CPU)
    dense_reference = ReferenceLinear(dataclasses.replace(spec, weight_format="dense", dtype=torch.float32), CPU)
    for num_tokens in num_tokens_list:
        x, weight, scale = fp8_linear_case(spec, num_tokens, seed=seed + num_tokens)
        x = round_to(x, dtype)
        actual = backend.forward(x.to(device=device, dtype=dtype), weight.to(device), scale.to(device))
        what = f"linear forward, {num_tokens} tokens, {spec}"
        if actual.dtype != dtype:
            raise AssertionError(f"{what}: returned {actual.dtype}, expected the input's {dtype}")
        expected = reference.forward(x, weight, scale)
        dense = reference.dense_weight(weight, scale)
        magnitude = dense_reference.forward(x.abs(), dense.abs(), None)
        row_max = x.abs().flatten(1).amax(dim=1, keepdim=True)
        subnormal = 2.0**-10 * row_max / 448.0 * dense.abs().sum(dim=1).max()
        bound = FP8_ACTIVATION_ERROR * magnitude + subnormal + atol + rtol * expected.abs()
        error = (actual.detach().float().cpu() - expected).abs()
        if actual.shape != expected.shape:
            raise AssertionError(f"{what}: shape {list(actual.shape)}, expected {list(expected.shape)}")
        if not bool((error <= bound).all()):
            worst = int((error - bound).flatten().argmax())
            raise AssertionError(f"{what}: error {error.flatten()[worst]:.3g} over the FP8 bound "
                                 f"{bound.flatten()[worst]:.3g} at flat index {worst}")


# ---------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------


def check_sampler(backend: SamplingBackend, device: torch.device, dtype: torch.dtype = torch.float32,
                  atol: float | None = None, rtol: float | None = None, seed: int = 0) -> None:
    """Greedy rows, logprobs, ranks and top logprobs match the reference; sampled rows draw inside
    their filtered support, never a banned id, and the same token whatever the batch order.

    Seeded draws need not reproduce the reference's random stream, so sampled tokens are not compared.
    """
    from deepinfer_core.reference.sampling import ReferenceSampler

    atol, rtol = tolerances(dtype, atol, rtol)
    logits, params = random_sampling_case(backend.spec, seed=seed)
    expected = ReferenceSampler(backend.spec, CPU).sample(logits, params)
    actual = backend.sample(logits.to(device), _params_to(params, device))
    tokens = actual.token_ids.cpu()
    is_greedy = params.temperature == 0
    if not torch.equal(tokens[is_greedy], expected.token_ids[is_greedy]):
        raise AssertionError(f"greedy rows chose {tokens[is_greedy].tolist()}, "
                             f"expected {expected.token_ids[is_greedy].tolist()}")
    raw = torch.log_softmax(logits.float(), dim=-1)
    chosen = raw.gather(1, tokens[:, None]).squeeze(1)
    assert_close(actual.logprobs, chosen, atol, rtol, "logprobs of the chosen tokens")
    expected_ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
    if not torch.equal(actual.ranks.cpu(), expected_ranks):
        raise AssertionError(f"ranks {actual.ranks.tolist()}, expected {expected_ranks.tolist()}")
    if actual.top_logprobs is None or actual.top_token_ids is None:
        raise AssertionError(f"num_logprobs={params.num_logprobs} but no top logprobs were returned")
    assert_close(actual.top_logprobs, expected.top_logprobs, atol, rtol, "top logprobs")
    if not torch.equal(actual.top_token_ids.cpu(), expected.top_token_ids):
        raise AssertionError("top token ids differ from the reference")
    _check_support(tokens, logits, params)
    _check_batch_invariance(backend, device, logits, params, tokens)


def _params_to(params: SamplingTensors, device: torch.device) -> SamplingTensors:
    return dataclasses.replace(params, **{
        f.name: getattr(params, f.name).to(device)
        for f in dataclasses.fields(params) if isinstance(getattr(params, f.name), torch.Tensor)})


def _check_support(tokens: torch.Tensor, logits: torch.Tensor, params: SamplingTensors) -> None:
    """Each row's token is not banned and not clearly outside its top-k / top-p / min-p filters."""
    for row, token in enumerate(tokens.tolist()):
        banned = (params.banned_token_ids or [[]] * len(tokens))[row]
        if token in banned:
            raise AssertionError(f"row {row} drew banned token {token}")
        temperature = float(params.temperature[row])
        if temperature == 0:
            continue
        scaled = logits[row].double() / temperature
        scaled[banned] = float("-inf")
        order = scaled.argsort(descending=True)
        rank = int((order == token).nonzero())
        top_k = int(params.top_k[row])
        if top_k > 0 and rank >= top_k:
            raise AssertionError(f"row {row} drew token {token} of rank {rank + 1}, outside top_k={top_k}")
        probs = torch.softmax(scaled[order[:top_k]] if top_k > 0 else scaled[order], dim=-1)
        mass_before = float(probs[:rank].sum())
        if mass_before > float(params.top_p[row]) + 1e-4:
            raise AssertionError(f"row {row} drew token {token} after {mass_before:.4f} of mass, "
                                 f"outside top_p={float(params.top_p[row])}")
        min_p = float(params.min_p[row])
        if min_p > 0 and float(probs[rank]) < min_p * float(probs[0]) * (1 - 1e-3):
            raise AssertionError(f"row {row} drew token {token} below min_p={min_p}")


def _check_batch_invariance(backend: SamplingBackend, device: torch.device, logits: torch.Tensor,
                            params: SamplingTensors, tokens: torch.Tensor) -> None:
    order = torch.arange(len(tokens) - 1, -1, -1)
    banned = params.banned_token_ids
    reversed_params = dataclasses.replace(
        params, banned_token_ids=None if banned is None else [banned[i] for i in order.tolist()],
        **{f.name: getattr(params, f.name)[order] for f in dataclasses.fields(params)
           if isinstance(getattr(params, f.name), torch.Tensor)})
    again = backend.sample(logits[order].to(device), _params_to(reversed_params, device)).token_ids.cpu()
    if not torch.equal(again[order], tokens):
        raise AssertionError(f"seeded draws depend on the batch order: {tokens.tolist()} vs "
                             f"{again[order].tolist()} with the batch reversed")
