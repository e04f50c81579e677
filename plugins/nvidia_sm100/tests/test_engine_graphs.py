"""The whole engine on the plugin's backends: decode replayed from CUDA graphs gives the eager tokens.

Needs the plugin installed (its `deepinfer` entry point) and a CUDA device of compute capability >= 9.0.
"""

from __future__ import annotations

import json

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config
from deepinfer_core.testing.serving import serve

CONFIG = tiny_config("hca128")  # window 16, CSA rate 4, HCA rate 128
LENGTHS = [5, 30, 120, 250, 500]  # decode crosses CSA closes, and HCA closes at 128 and 256
MAX_TOKENS = [20, 12, 20, 16, 9]  # the batch shrinks: 5 then 4 then 3 requests, padded to 8 and 4


def make_engine(tmp_path, enforce_eager: bool) -> Engine:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    options = {"max_num_seqs": 8, "max_model_len": 1024, "num_kv_blocks": 64, "device": "cuda"}
    config = EngineConfig(model=str(tmp_path), dtype="float32", enforce_eager=enforce_eager, **options)
    return Engine(config, weights=random_state_dict(CONFIG, seed=4))


def generate(engine: Engine, prompts: list[list[int]]) -> dict[str, tuple[list[int], list[float]]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    done = {}
    for out in serve(engine, prompts, params):
        completion = out.outputs[0]
        logprobs = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        done[out.request_id] = (list(completion.token_ids), logprobs)
    return done


def test_graph_decode_gives_the_eager_tokens(cuda_device: torch.device, tmp_path) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in LENGTHS]
    (tmp_path / "eager").mkdir()
    (tmp_path / "graphs").mkdir()
    eager = make_engine(tmp_path / "eager", enforce_eager=True)
    graphed = make_engine(tmp_path / "graphs", enforce_eager=False)
    model = graphed.runner.model
    backends = {type(b).__name__ for b in [*model.attention_backends, *model.moe_backends]}
    assert backends == {"TritonAttention", "TritonMoE"}, "the nvidia_sm100 plugin must serve this test"
    assert eager.runner.graphs is None
    assert graphed.runner.graphs is not None and sorted(graphed.runner.graphs.graphs) == [(1, 1), (2, 1), (4, 1), (8, 1)]  # (batch, tokens each)
    expected, actual = generate(eager, prompts), generate(graphed, prompts)
    for i in range(len(prompts)):
        tokens, logprobs = actual[str(i)]
        assert tokens == expected[str(i)][0], i
        assert max(abs(a - b) for a, b in zip(logprobs, expected[str(i)][1])) < 1e-3, i
