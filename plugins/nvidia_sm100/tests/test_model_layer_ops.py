"""The whole model with the plugin's layer ops (and the reference attention and MoE) against transformers:
every position's logprobs, fp32, prompts chunked across steps. Compiled on a GPU, interpreted by Triton on
the CPU."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.worker.runner import ModelRunner
from tests.oracle import hf_logprobs, hf_model, parity_config, random_state_dict, run_chunked


class LayerOpsEverywhere:
    """Serves the plugin's layer ops on any device (the plugin itself declines off CUDA)."""

    @hookimpl
    def make_layer_ops(self, spec, device):
        from deepinfer_nvidia_sm100.layer_ops import TritonLayerOps

        return TritonLayerOps(spec, device)


# sizes kept small: off the GPU every kernel program runs in Triton's interpreter
@pytest.mark.parametrize(("preset", "overrides", "chunk", "lengths"), [
    ("sliding_csa_hca", {}, 7, (1, 9, 40)),  # hc_mult 2, CSA + HCA compressors, prompts split mid-window
    ("deep", {"scoring_func": "sigmoid"}, 1000, (1, 33)),  # hc_mult 4, two CSA layers, whole prompts
])
def test_every_position_matches_transformers(kernel_device, isolated_plugin_manager, tmp_path, preset,
                                             overrides, chunk, lengths):
    from deepinfer_nvidia_sm100.layer_ops import TritonLayerOps

    isolated_plugin_manager.register(LayerOpsEverywhere(), name="layer-ops-everywhere")
    config = parity_config(preset, **overrides)
    weights = random_state_dict(config, seed=7)
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    model_config = ModelConfig.from_dict(config)
    engine_config = EngineConfig(model=str(tmp_path), dtype="float32", max_num_seqs=4, num_kv_blocks=40,
                                 enforce_eager=True).resolve(model_config)
    runner = ModelRunner(model_config, engine_config, kernel_device, weights=weights)
    assert isinstance(runner.model.ops, TritonLayerOps)
    generator = torch.Generator().manual_seed(chunk)
    prompts = [torch.randint(2, config["vocab_size"], (n,), generator=generator).tolist() for n in lengths]
    oracle = hf_model(config, weights)
    for prompt, mine in zip(prompts, run_chunked(runner, prompts, chunk)):
        expected = hf_logprobs(oracle, prompt)
        assert torch.equal(mine.argmax(-1), expected.argmax(-1)), f"greedy tokens differ (len {len(prompt)})"
        assert (mine - expected).abs().max().item() < 1e-4, f"len {len(prompt)}"
