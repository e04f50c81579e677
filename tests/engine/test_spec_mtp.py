"""The MTP drafter: the checkpoint's `mtp.*` layer drafts, output identical to no speculation (greedy
and seeded, every k, batches, preemption, prefix hits), its weights read in every layout, and a clear
error without them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.models.mtp import MTPWeightsMissingError
from deepinfer_core.models.mtp_weights import to_internal
from tests.engine.test_spec_decode import CONFIG, MIXED, generate, tokens
from tests.oracle import random_state_dict, write_config

WEIGHTS = random_state_dict(CONFIG, seed=5, mtp_layers=1)  # the target's weights equal test_spec_decode's


def make_engine(tmp_path, spec=None, weights=WEIGHTS, **options) -> Engine:
    if spec is not None:  # these tests check the verification machinery: verify every draft
        spec = {"draft_length_policy": "fixed", **spec}
    write_config(tmp_path, CONFIG)
    options = {"max_num_seqs": 4, "num_kv_blocks": 24, **options}
    return Engine(EngineConfig(model=str(tmp_path), dtype="float32", speculative_config=spec, **options),
                  weights=weights)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return tokens(generate(make_engine(tmp_path_factory.mktemp("ref")), MIXED, temperature=0))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_mtp_greedy_equals_no_speculation_for_every_k(tmp_path, reference, k):
    engine = make_engine(tmp_path, {"method": "mtp", "num_speculative_tokens": k})
    assert tokens(generate(engine, MIXED, temperature=0)) == reference
    stats = engine.stats()
    assert stats["spec_verified_tokens"] >= stats["spec_verify_steps"] > 0  # MTP drafts were verified
    assert engine.runner.mtp is not None and engine.runner.mtp.num_drafts == k


def test_mtp_seeded_sampling_preemption_and_prefix_hits(tmp_path):
    batch = torch.randint(2, CONFIG["vocab_size"], (2, 125), generator=torch.Generator().manual_seed(4)).repeat(1, 2).tolist()
    options = {"num_kv_blocks": 4, "enable_prefix_caching": True, "max_num_batched_tokens": 64}
    params = {"temperature": 1.0, "seed": 3}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    plain = make_engine(tmp_path / "a", **options)
    expected = [tokens(generate(plain, batch, **params)) for _ in range(2)]
    engine = make_engine(tmp_path / "b", {"method": "mtp", "num_speculative_tokens": 2,
                                          "draft_length_policy": "confidence"}, **options)
    assert [tokens(generate(engine, batch, **params)) for _ in range(2)] == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0 and stats["spec_drafted_tokens"] > 0


def test_mtp_without_mtp_weights_is_a_clear_error(tmp_path):
    target_only = {n: t for n, t in WEIGHTS.items() if not n.startswith("mtp.")}
    with pytest.raises(MTPWeightsMissingError, match="method 'ngram'"):
        make_engine(tmp_path, {"method": "mtp", "num_speculative_tokens": 1}, weights=target_only)


def official_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MTP tensors as DeepSeek's release names them (per-expert w1/w2/w3, attn.*, hc_head_fn, ...)."""
    from deepinfer_core.models.checkpoint_layout import _PER_LAYER

    own = {"hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
    out = {}
    for name, tensor in weights.items():
        key = name.removeprefix("mtp.0.")
        if key == "mlp.experts.gate_up_proj":
            w1, w3 = tensor.chunk(2, dim=1)
            out |= {f"mtp.0.ffn.experts.{e}.w1.weight": w1[e] for e in range(len(w1))}
            out |= {f"mtp.0.ffn.experts.{e}.w3.weight": w3[e] for e in range(len(w3))}
        elif key == "mlp.experts.down_proj":
            out |= {f"mtp.0.ffn.experts.{e}.w2.weight": tensor[e] for e in range(len(tensor))}
        else:
            out[f"mtp.0.{_PER_LAYER.get(key, own.get(key, key))}"] = tensor
    return out


def test_mtp_weights_read_in_the_official_and_transformers_layouts(tmp_path):
    internal = {n: t for n, t in WEIGHTS.items() if n.startswith("mtp.")}
    official = official_names(internal)
    assert set(official) != set(internal)
    expected = {n.removeprefix("mtp."): t for n, t in internal.items()}
    for names in (official, {"model." + n.replace("attn.kv_norm.", "attn.norm."): t for n, t in official.items()},
                  internal):
        loaded = to_internal(names)
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[n], expected[n]) for n in expected)


def test_mtp_weights_load_from_the_checkpoint_directory(tmp_path, reference):
    target_only = {n: t for n, t in WEIGHTS.items() if not n.startswith("mtp.")}
    official = official_names({n: t for n, t in WEIGHTS.items() if n.startswith("mtp.")})
    save_file({n: t.contiguous() for n, t in official.items()}, str(tmp_path / "mtp.safetensors"))
    engine = make_engine(tmp_path, {"method": "mtp", "num_speculative_tokens": 2}, weights=target_only)
    layer = engine.runner.mtp.module[0]
    torch.testing.assert_close(layer.e_proj.weight, WEIGHTS["mtp.0.e_proj.weight"], rtol=0, atol=0)
    assert tokens(generate(engine, MIXED[:1], temperature=0))["0"] == reference["0"]


def test_rejection_sampling_uses_the_mtp_layers_draft_distributions(tmp_path):
    engine = make_engine(tmp_path, {"method": "mtp", "num_speculative_tokens": 2, "acceptance": "rejection"})
    verifier, calls = engine.runner.spec.verifier, []
    verify = verifier.verify

    def recorded(drafts, probs, logits, temperature, generator=None):
        calls.append((drafts, probs))
        return verify(drafts, probs, logits, temperature, generator)

    verifier.verify = recorded
    outputs = generate(engine, MIXED, temperature=1.0)  # no seed: rejection sampling verifies them
    assert all(len(out.outputs[0].token_ids) == 10 for out in outputs.values())
    given = [(drafts, probs) for drafts, probs in calls if probs is not None]
    assert given and len(given) == len(calls)  # every verified draft came with the MTP's q
    for drafts, probs in given:
        assert probs.shape == (*drafts.shape, CONFIG["vocab_size"])
        torch.testing.assert_close(probs.sum(-1), torch.ones(drafts.shape))
        assert (probs.gather(-1, drafts[..., None]) > 0).all()  # each draft was drawn from its q


def test_mtp_steps_are_never_left_in_flight(tmp_path, reference):
    """Overlapped decode on: a step that brought the MTP layer's next drafts is read at once (its drafts
    would otherwise be lost), so the output is unchanged and no step was left in flight."""
    engine = make_engine(tmp_path, {"method": "mtp", "num_speculative_tokens": 2}, async_scheduling=True)
    settled = []
    settle = engine._settle
    engine._settle = lambda in_flight, touched: settled.append(in_flight) or settle(in_flight, touched)
    assert tokens(generate(engine, MIXED, temperature=0)) == reference
    assert settled == [] and engine.stats()["spec_verify_steps"] > 0
