"""V4.1's FP8 projections kept in the checkpoint's bytes (`quantized_weights="native"`, as V4's): the
loaded model holds float8_e4m3fn weights with float32 (UE8M0) 32x32 block scales exactly where the release
stores FP8, runs them through the linear backend, and generates what the dequantise-at-load path does;
the DSpark drafter's stages hold theirs as the target does."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.backends import quant
from deepinfer_core.models.deepseek_v4.layers import FP8Linear
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.release import released_tensors
from tests.models.v41_helpers import dspark_checkpoint, make_engine, random_prompt, run, tiny_checkpoint

OPTIONS = {"dtype": "bfloat16", "max_num_seqs": 2, "num_kv_blocks": 8}


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)[0]


def released_fp8_projections(config, prefix: str = "layers.") -> set[str]:
    """The modules whose weight the release stores in FP8: every FP8 tensor but routed experts and Engram tables."""
    return {t.name.removesuffix(".weight") for t in released_tensors(config, include_vision=False)
            if t.dtype == "F8_E4M3" and t.name.startswith(prefix) and ".experts." not in t.name
            and not t.name.endswith(".embed.weight")}


def held_fp8(module, prefix: str = "") -> dict[str, FP8Linear]:
    return {prefix + name: m for name, m in module.named_modules() if isinstance(m, FP8Linear)}


def outputs(engine, prompts) -> list[tuple[list[int], list[float]]]:
    results = []
    for output in run(engine, prompts, 8):
        completion = output.outputs[0]
        chosen = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        results.append((list(completion.token_ids), chosen))
    return results


def test_native_fp8_projections_are_held_in_fp8_and_generate_like_dequantised_ones(directory):
    config = V41Config.from_dir(directory)
    native = make_engine(directory, None, **OPTIONS)
    dequantised = make_engine(directory, None, quantized_weights="dequantize", **OPTIONS)
    held = held_fp8(native.runner.model)
    # attention wq_a/wq_b/wkv/wo_a/wo_b, the indexers' wq_b, the shared experts and Engram's wkv
    assert set(held) == released_fp8_projections(config)
    assert {name.rsplit(".", 1)[-1] for name in held} == {"wq_a", "wq_b", "wkv", "wo_a", "wo_b", "w1", "w2", "w3"}
    for name, module in held.items():
        assert module.weight.dtype == quant.FP8_DTYPE and module.weight_scale.dtype == torch.float32, name
        assert module.spec.block == (32, 32) and module.spec.scale_format == "ue8m0", name
        assert type(module.backend).__name__ == "ReferenceLinear", name
        assert torch.equal(module.weight_scale, torch.exp2(torch.log2(module.weight_scale).round())), name  # UE8M0
    assert held["layers.0.attn.wo_a"].spec.groups == config.o_groups
    assert native.runner.linear_backends and not held_fp8(dequantised.runner.model)
    dense = dict(dequantised.runner.model.named_modules())
    for name, module in held.items():  # the FP8 bytes are the dequantised weights' values
        want = dense[name].weight
        got = quant.dequantize_fp8(module.weight, module.weight_scale, module.spec.block).to(want.dtype)
        assert torch.equal(got, want), name
    prompts = [random_prompt(37, seed=1), random_prompt(10, seed=2)]
    got, want = outputs(native, prompts), outputs(dequantised, prompts)
    for (got_ids, got_logprobs), (want_ids, want_logprobs) in zip(got, want, strict=True):
        assert got_ids == want_ids
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=1e-4)


def test_the_dspark_stages_hold_fp8_projections_as_the_target_does(tmp_path_factory):
    directory = dspark_checkpoint(tmp_path_factory)[0]
    config = V41Config.from_dir(directory)
    engine = make_engine(directory, None, speculative_config={"method": "dspark", "num_speculative_tokens": 2},
                         **OPTIONS)
    drafter = engine.runner.mtp
    held = held_fp8(drafter.module.mtp, "mtp.")
    assert set(held) == released_fp8_projections(config, "mtp.") and "mtp.0.main_proj" in held
    assert all(m.weight.dtype == quant.FP8_DTYPE and m.backend in drafter.backends for m in held.values())
    run(engine, [random_prompt(40, seed=3)], 6)
    assert engine.stats()["spec_verified_tokens"] > 0


def test_dspark_fp8_stages_compute_what_dequantised_ones_do(tmp_path_factory):
    """The block's outputs of stages holding FP8 projections (on the reference linear backend) equal those
    of the stages loaded dequantised."""
    from deepinfer_core import plugins
    from deepinfer_core.models.deepseek_v41.dspark_weights import build_dspark, load_dspark_weights
    from deepinfer_core.models.loading import weight_formats

    directory, weights = dspark_checkpoint(tmp_path_factory)
    config = V41Config.from_dir(directory)
    engine = make_engine(directory, weights, max_num_seqs=1)
    cpu = torch.device("cpu")
    results = []
    for keep_fp8 in (True, False):
        module = build_dspark(config, torch.float32, load_dspark_weights(directory, config, torch.float32, "cpu",
                                                                       keep_fp8=keep_fp8), "cpu")
        assert bool(weight_formats.bind_linears(module, plugins.make_linear, cpu)) == keep_fp8
        module.bind(engine.runner.model, [plugins.make_moe(module.plans[0].moe, cpu)] * len(module.mtp))
        context = [torch.randn(1, module.window, config.head_dim, generator=torch.Generator().manual_seed(1))
                   for _ in module.mtp]
        taps = torch.randn(3, len(config.dspark_target_layer_ids) * config.hidden_size,
                           generator=torch.Generator().manual_seed(2))
        kv = module.context_kv(taps, torch.arange(3))
        hidden, logits = module.block(torch.tensor([5]), torch.tensor([30]), context,
                                      torch.ones(1, module.window, dtype=torch.bool))
        results.append((kv, hidden, logits))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
