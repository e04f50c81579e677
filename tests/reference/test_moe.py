"""Reference MoE: both execution paths agree, and routing follows V4's rules."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import MoESpec, MoEWeights
from deepinfer_core.reference import moe


def make_case(is_hash: bool, scoring: str, tokens: int = 40, experts: int = 8, top_k: int = 3):
    g = torch.Generator().manual_seed(0)
    spec = MoESpec(hidden_size=16, intermediate_size=8, num_experts=experts, top_k=top_k, scoring_func=scoring,
                   routed_scaling_factor=1.5, swiglu_limit=0.5, is_hash=is_hash)
    weights = MoEWeights(
        router=torch.randn(experts, 16, generator=g), gate_up=torch.randn(experts, 16, 16, generator=g),
        down=torch.randn(experts, 16, 8, generator=g), score_bias=torch.randn(experts, generator=g),
        tid2eid=torch.rand(50, experts, generator=g).argsort(dim=1)[:, :top_k],
    )
    return spec, weights, torch.randn(tokens, 16, generator=g), torch.randint(0, 50, (tokens,), generator=g)


@pytest.mark.parametrize("is_hash", [False, True])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_gathered_and_per_expert_paths_agree(monkeypatch, is_hash, scoring):
    spec, weights, x, ids = make_case(is_hash, scoring)
    backend = moe.ReferenceMoE(spec, torch.device("cpu"))
    gathered = backend.forward(x, ids, weights)
    monkeypatch.setattr(moe, "GATHER_LIMIT", 0)
    per_expert = backend.forward(x, ids, weights)
    assert torch.allclose(gathered, per_expert, atol=1e-5)


def test_routing_uses_bias_for_choice_only_and_hash_table():
    spec, weights, x, ids = make_case(False, "sigmoid")
    chosen, routing = moe.route(x, ids, weights, spec)
    scores = torch.sigmoid(x @ weights.router.T)
    assert torch.equal(chosen.sort(-1).values, (scores + weights.score_bias).topk(3).indices.sort(-1).values)
    picked = scores.gather(1, chosen)
    assert torch.allclose(routing, picked / picked.sum(-1, keepdim=True) * 1.5)
    hash_spec, weights, x, ids = make_case(True, "sigmoid")
    assert torch.equal(moe.route(x, ids, weights, hash_spec)[0], weights.tid2eid[ids])
