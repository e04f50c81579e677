"""The MTP drafter: the checkpoint's `mtp.*` layer drafts, output identical to no speculation (greedy
and seeded, every k, batches, preemption, prefix hits), on a quantised official checkpoint too (its MTP
layer held as the target's layers are), and a clear error without its weights or with a bad scale.
Reading the weights in every layout: tests/models/test_mtp_weights.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core.backends import quant
from deepinfer_core.config import CheckpointError, EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.models.deepseek_v4.layers import FP4Experts, FP8Linear
from deepinfer_core.models.deepseek_v4.mtp import MTPWeightsMissingError
from deepinfer_core.models.tiny import write_checkpoint
from tests.engine.test_spec_decode import CONFIG, MIXED, generate, tokens
from tests.oracle import random_state_dict, write_config

WEIGHTS = random_state_dict(CONFIG, seed=5, mtp_layers=1)  # the target's weights equal test_spec_decode's


def make_engine(tmp_path, spec=None, weights=WEIGHTS, **options) -> Engine:
    """An engine on `WEIGHTS`; with `spec`, every MTP draft is verified unless it names its policy (the
    random MTP layer's drafts are too unlikely for the confidence policy, the default, to verify any)."""
    write_config(tmp_path, CONFIG)
    spec = {"draft_length_policy": "fixed", **spec} if spec is not None else None
    options = {"max_num_seqs": 4, "num_kv_blocks": 24, **options}
    return Engine(EngineConfig(model=str(tmp_path), dtype="float32", speculative_config=spec, **options),
                  weights=weights)


def echo_weights(weights: dict[str, torch.Tensor] = WEIGHTS) -> dict[str, torch.Tensor]:
    """`weights` made into a model whose MTP layer predicts exactly what the target will: every
    attention and MoE output is zero, so a position's residual streams are copies of its token's
    embedding scaled (mHC's mixing keeps equal copies equal), and the target's next token is a function
    of its input token alone. The MTP layer reads the next token's embedding alone (`h_proj` zero,
    `e_proj` the identity) and ends in the target's final norm, so it computes that same function: every
    draft is the token the target then emits, at any depth."""
    echo = dict(weights)
    for name, tensor in weights.items():
        if name.endswith(("o_b_proj.weight", "experts.down_proj", "shared_experts.down_proj.weight")):
            echo[name] = torch.zeros_like(tensor)
    echo["mtp.0.h_proj.weight"] = torch.zeros_like(weights["mtp.0.h_proj.weight"])
    echo["mtp.0.e_proj.weight"] = torch.eye(CONFIG["hidden_size"], dtype=weights["mtp.0.e_proj.weight"].dtype)
    echo["mtp.0.enorm.weight"] = torch.ones_like(weights["mtp.0.enorm.weight"])
    echo["mtp.0.norm.weight"] = weights["model.norm.weight"].clone()
    return echo


def test_every_draft_of_an_mtp_layer_that_predicts_the_target_is_accepted(tmp_path):
    """After accepted drafts the drafter must continue from the token the step emitted last (the
    target's token after the accepted drafts): with an MTP layer that computes the target's own next
    token, a slip there drafts a wrong token (reading the first emitted row instead fails here, and
    nowhere else), so every draft is accepted, at every depth, and the output is unchanged."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    weights = echo_weights()
    want = tokens(generate(make_engine(tmp_path / "a", weights=weights), MIXED, temperature=0))
    engine = make_engine(tmp_path / "b", {"method": "mtp", "num_speculative_tokens": 3}, weights=weights)
    assert tokens(generate(engine, MIXED, temperature=0)) == want
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_verified_tokens"] > 2 * stats["spec_verify_steps"] > 0


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


def test_mtp_weights_load_from_the_checkpoint_directory(tmp_path, reference):
    """The target's weights in memory, the MTP layer's only in the directory (official names)."""
    target_only = {n: t for n, t in WEIGHTS.items() if not n.startswith("mtp.")}
    written = write_checkpoint(tmp_path / "written", CONFIG, WEIGHTS, layout="official")
    mtp_only = {n: t for n, t in load_file(written / "model.safetensors").items() if n.startswith("mtp.")}
    assert "mtp.0.ffn.experts.0.w1.weight" in mtp_only and "mtp.0.hc_head_fn" in mtp_only
    save_file(mtp_only, str(tmp_path / "mtp.safetensors"))
    engine = make_engine(tmp_path, {"method": "mtp", "num_speculative_tokens": 2}, weights=target_only)
    layer = engine.runner.mtp.module[0]
    torch.testing.assert_close(layer.e_proj.weight, WEIGHTS["mtp.0.e_proj.weight"], rtol=0, atol=0)
    assert tokens(generate(engine, MIXED[:1], temperature=0))["0"] == reference["0"]


@pytest.fixture(scope="module")
def quantised_dir(tmp_path_factory):
    """DeepSeek's release layout and storage: FP8 projections with UE8M0 block scales and packed FP4
    routed experts, the MTP layer's (`mtp.0.*`) included."""
    return write_checkpoint(tmp_path_factory.mktemp("fp8_fp4"), CONFIG, WEIGHTS, layout="official", quant="fp8+fp4")


def checkpoint_engine(model_dir, spec=None, **options) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", speculative_config=spec, max_num_seqs=4,
                               num_kv_blocks=24, **options))


@pytest.mark.parametrize("quantized_weights", ["native", "dequantize"])
def test_mtp_on_a_quantised_official_checkpoint(quantised_dir, quantized_weights):
    """The MTP layer loads from FP8 / FP4 tensors, holds them as the target holds its layers', and greedy
    output with MTP drafting equals greedy output without speculation."""
    expected = tokens(generate(checkpoint_engine(quantised_dir, quantized_weights=quantized_weights), MIXED,
                               temperature=0))
    spec = {"method": "mtp", "num_speculative_tokens": 3, "draft_length_policy": "fixed"}  # every draft verified
    engine = checkpoint_engine(quantised_dir, spec, quantized_weights=quantized_weights)
    assert tokens(generate(engine, MIXED, temperature=0)) == expected
    stats = engine.stats()
    assert stats["spec_verified_tokens"] > stats["spec_verify_steps"] > 0  # k drafts a step, less near the end
    layer, target = engine.runner.mtp.module[0], engine.runner.model.model.layers[0]
    is_native = quantized_weights == "native"
    assert isinstance(layer.mlp.experts, FP4Experts) is isinstance(target.mlp.experts, FP4Experts) is is_native
    for name in ("self_attn.q_a_proj", "self_attn.o_b_proj", "mlp.shared_experts.down_proj"):
        assert isinstance(layer.get_submodule(name), FP8Linear) is isinstance(target.get_submodule(name), FP8Linear)
    assert isinstance(layer.e_proj, FP8Linear) is isinstance(layer.h_proj, FP8Linear) is is_native
    on_disk = load_file(quantised_dir / "model.safetensors")
    down = torch.stack([on_disk[f"mtp.0.ffn.experts.{e}.w2.weight"] for e in range(CONFIG["n_routed_experts"])])
    down_scale = torch.stack([on_disk[f"mtp.0.ffn.experts.{e}.w2.scale"] for e in range(CONFIG["n_routed_experts"])])
    e_proj, e_scale = on_disk["mtp.0.e_proj.weight"], on_disk["mtp.0.e_proj.scale"]
    if is_native:  # the bytes written
        assert torch.equal(layer.mlp.experts.down_proj, down) and torch.equal(layer.e_proj.weight_scale, e_scale.float())
        assert torch.equal(layer.e_proj.weight.view(torch.uint8), e_proj.view(torch.uint8))
    else:  # their dequantised values
        assert torch.equal(layer.mlp.experts.down_proj, quant.dequantize_fp4(down, down_scale))
        assert torch.equal(layer.e_proj.weight, quant.dequantize_fp8(e_proj, e_scale, (128, 128)))


def test_a_misshaped_mtp_scale_is_a_clear_error(tmp_path):
    model_dir = write_checkpoint(tmp_path, CONFIG, WEIGHTS, layout="official", quant="fp8+fp4")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["mtp.0.attn.wq_a.scale"] = tensors["mtp.0.attn.wq_a.scale"].repeat(2, 1)
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mtp\.0\.attn\.wq_a\.scale has shape \[2, 1\], expected \[1, 1\]"):
        checkpoint_engine(model_dir, {"method": "mtp", "num_speculative_tokens": 1})


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
    settle = engine.steps.settle
    engine.steps.settle = lambda in_flight, touched: settled.append(in_flight) or settle(in_flight, touched)
    assert tokens(generate(engine, MIXED, temperature=0)) == reference
    assert settled == [] and engine.stats()["spec_verify_steps"] > 0


def test_deeper_drafts_sampling_tensors_equal_a_rebuild_at_their_positions():
    """Each depth's sampling tensors are the first depth's with `steps` moved on, except for rows whose
    banned ids follow the position (`min_tokens`): those are rebuilt, and then equal a fresh build."""
    from types import SimpleNamespace

    from deepinfer_core import SamplingParams
    from deepinfer_core.speculative.mtp_drafter import DraftTarget

    target = DraftTarget(SimpleNamespace(eos_token_ids=[1], vocab_size=64), make_context=None, sampler=None,
                         num_slots=2, dtype=torch.float32, device=torch.device("cpu"))

    def state(**params):
        return SimpleNamespace(sampling_params=SamplingParams(**params), seed=7, num_prompt_tokens=10)

    for states, moved in (([state(temperature=0.8, top_k=5), state(temperature=0)], True),
                          ([state(temperature=0.8, min_tokens=4), state(temperature=0)], False)):
        sampled = [(0, 12), (1, 15)]  # drafting positions 12 and 15: 2 and 5 tokens generated
        tensors = target.draft_tensors(states, sampled)
        for depth in (1, 2):
            shifted = [(i, p + depth) for i, p in sampled]
            deeper, fresh = target.next_draft_tensors(tensors, states, shifted), target.draft_tensors(states, shifted)
            assert torch.equal(deeper.steps, fresh.steps) and deeper.banned_token_ids == fresh.banned_token_ids
            assert (deeper.temperature is tensors.temperature) == moved  # moved on, or rebuilt
            tensors = deeper
        if not moved:  # min_tokens 4: EOS banned while 2 and 3 are generated, lifted at 4
            assert target.draft_tensors(states, sampled).banned_token_ids[0] == [1]
            assert tensors.banned_token_ids is None
