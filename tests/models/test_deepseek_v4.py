"""Model parity with transformers' DeepseekV4ForCausalLM: every position's logprobs, any chunking."""

from __future__ import annotations

import pytest
import torch

from tests.oracle import (
    FakeSeq,
    all_position_logprobs,
    hf_logprobs,
    hf_model,
    make_runner,
    parity_config,
    random_state_dict,
    run_chunked,
)

TOL = 1e-4
CONFIGS = {
    "sliding_csa_hca": {},  # hc_mult 2, yarn compress rope, hash + top-k MoE
    "hca128": {"hc_mult": 3},
    "deep": {"scoring_func": "sigmoid"},  # hc_mult 4, two CSA layers
    "sliding_only": {},  # hc_mult 1
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_pair(request, tmp_path_factory):
    config = parity_config(request.param, **CONFIGS[request.param])
    weights = random_state_dict(config, seed=7)
    return config, weights, hf_model(config, weights)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_every_position_matches_transformers(model_pair, tmp_path, chunk):
    config, weights, oracle = model_pair
    runner = make_runner(tmp_path, config, weights)
    generator = torch.Generator().manual_seed(chunk)
    lengths = [1, 4, 17, 61, 150]  # from one token to past the window, several CSA/HCA windows
    prompts = [torch.randint(2, config["vocab_size"], (n,), generator=generator).tolist() for n in lengths]
    for prompt, mine in zip(prompts, run_chunked(runner, prompts, chunk)):
        expected = hf_logprobs(oracle, prompt)
        assert torch.equal(mine.argmax(-1), expected.argmax(-1)), f"greedy tokens differ (len {len(prompt)})"
        assert (mine - expected).abs().max().item() < TOL, f"len {len(prompt)}, chunk {chunk}"


def test_incremental_decode_equals_full_forward(tmp_path):
    config = parity_config("hca128")
    runner = make_runner(tmp_path, config, random_state_dict(config, seed=3))
    prompt = torch.randint(2, config["vocab_size"], (300,), generator=torch.Generator().manual_seed(0)).tolist()
    full = run_chunked(runner, [prompt], chunk=1000)[0]
    runner.kv_cache = make_runner(tmp_path, config, random_state_dict(config, seed=3)).kv_cache  # fresh state
    prefill_then_decode = run_chunked_then_decode(runner, prompt, prefill=130)
    assert (full - prefill_then_decode).abs().max().item() < 1e-5


def run_chunked_then_decode(runner, prompt, prefill):
    seq = FakeSeq(prompt, slot=0, block_table=list(range(8)))
    parts = all_position_logprobs(runner, [seq], [prefill])
    while seq.num_computed_tokens < seq.num_tokens:
        parts += all_position_logprobs(runner, [seq], [1])
    return torch.cat(parts)


def test_compress_rates_must_divide_the_cache_block():
    from deepinfer_core.config import ModelConfig
    from deepinfer_core.models.layer_plan import build_layer_plan

    config = ModelConfig.from_dict(parity_config("sliding_csa_hca", compress_rates={
        "compressed_sparse_attention": 4, "heavily_compressed_attention": 48}))
    with pytest.raises(NotImplementedError, match="128-token block"):
        build_layer_plan(config, torch.float32)
