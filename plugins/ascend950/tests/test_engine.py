"""The whole engine on the plugin's backends over the op doubles, against the engine on the reference.

A tiny V4 (head_dim 512 as the op requires, sliding window, CSA and HCA layers) runs in fp16 on the CPU
twice: once with every backend the reference's, once with the plugin's (built on the CPU over the
doubles by a test plugin, since the hooks themselves build only for an NPU). This checks the plugin
against the engine's real cache layout (window rings, the paged pools with their scratch row, shared
pools, block id 0 in use), not the chip. fp16 rather than bf16: in bf16 the MoE's different rounding
(fp32 accumulation in the grouped GEMM double, bf16 in the reference) flips one near-tied greedy token
of one request; every other backend alone matches in bf16 too.
"""

from __future__ import annotations

import json

import torch
from deepinfer_ascend950.attention import AscendAttention
from deepinfer_ascend950.layer_ops import AscendLayerOps
from deepinfer_ascend950.moe import AscendMoE
from deepinfer_ascend950.sampling import AscendSampler

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config
from deepinfer_core.testing.serving import serve

CONFIG = tiny_config("hca128", head_dim=512, num_attention_heads=2)
CPU = torch.device("cpu")


class PluginBackendsOnTheCpu:
    """The plugin's backend classes, built for the CPU over the doubles."""

    def __init__(self, doubles):
        self.doubles, self.attention = doubles, []

    @hookimpl
    def make_attention(self, spec, device):
        self.attention.append(AscendAttention(spec, CPU, self.doubles.cann_ops_module()))
        return self.attention[-1]

    @hookimpl
    def make_moe(self, spec, device):
        return AscendMoE(spec, CPU, self.doubles.torch_npu_module())

    @hookimpl
    def make_layer_ops(self, spec, device):
        return AscendLayerOps(spec, self.doubles.torch_npu_module())

    @hookimpl
    def make_sampler(self, spec, device):
        return AscendSampler(spec, CPU)


def generate(tmp_path, prompts):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    config = EngineConfig(model=str(tmp_path), dtype="float16", device="cpu", max_num_seqs=4, max_model_len=512,
                          num_kv_blocks=16, enforce_eager=True)
    engine = Engine(config, weights=random_state_dict(CONFIG, seed=2))
    done = {}
    for out in serve(engine, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)):
        completion = out.outputs[0]
        done[out.request_id] = (list(completion.token_ids),
                                [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)])
    return done


def test_greedy_tokens_and_logprobs_match_the_reference_engine(tmp_path, isolated_plugin_manager, doubles):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in (5, 40, 150)]
    (tmp_path / "reference").mkdir()
    (tmp_path / "plugin").mkdir()
    expected = generate(tmp_path / "reference", prompts)
    plugin = PluginBackendsOnTheCpu(doubles)
    isolated_plugin_manager.register(plugin, name="ascend950-on-cpu")
    actual = generate(tmp_path / "plugin", prompts)
    assert plugin.attention, "the plugin's attention must serve the model"
    counts = [b.path_counts for b in plugin.attention]
    assert sum(c["sparse_flash_mla"] for c in counts) > 0  # sliding layers, and steps without block 0
    # block 0 is the engine's null block (`kv.cache.NULL_BLOCK`), never handed out: no step needs the fallback
    assert sum(c["fallback (block id 0)"] for c in counts) == 0
    for i in range(len(prompts)):
        assert actual[str(i)][0] == expected[str(i)][0], i
        assert max(abs(a - b) for a, b in zip(actual[str(i)][1], expected[str(i)][1])) < 0.05, i
