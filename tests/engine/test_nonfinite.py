"""A row whose logits are not finite ends its request with finish_reason "error", never a made-up token;
the other requests of the batch go on unchanged."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.testing.serving import serve
from tests.engine.test_engine import CONFIG, WEIGHTS
from tests.oracle import write_config

POISON = 7  # its embedding row is infinite: any request that reads it gets NaN logits


def engine_with(tmp_path, weights, **options) -> Engine:
    write_config(tmp_path, CONFIG)
    return Engine(EngineConfig(model=str(tmp_path), dtype="float32", max_num_seqs=4, num_kv_blocks=8, **options),
                  weights=weights)


def run(engine, prompts):
    outputs = serve(engine, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))
    return {o.request_id: o.outputs[0] for o in outputs}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_nonfinite_logits_end_that_request_alone_with_an_error(tmp_path, async_scheduling):
    generator = torch.Generator().manual_seed(3)
    clean = [torch.randint(POISON + 1, CONFIG["vocab_size"], (n,), generator=generator).tolist() for n in (20, 9)]
    engine = engine_with(tmp_path, WEIGHTS, async_scheduling=async_scheduling)
    embedding = engine.runner.model.model.embed_tokens.weight
    embedding.data = embedding.data.clone()  # its storage is WEIGHTS' (loaded by assignment): poison a copy
    embedding.data[POISON] = float("inf")  # after loading, which refuses non-finite weights
    mid_answer = clean[0][:5] + [POISON]  # poisoned from its first token on
    done = run(engine, [mid_answer, *clean])
    assert done["0"].finish_reason == "error" and done["0"].token_ids == [] and done["0"].logprobs == []
    reference = run(engine_with(tmp_path, WEIGHTS), clean)
    for i in (1, 2):
        assert done[str(i)].finish_reason == "length"
        assert done[str(i)].token_ids == reference[str(i - 1)].token_ids


def test_given_weights_are_checked_like_a_checkpoints(tmp_path):
    poisoned = dict(WEIGHTS)
    poisoned["lm_head.weight"] = WEIGHTS["lm_head.weight"].clone()
    poisoned["lm_head.weight"][3, 1] = float("nan")
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine_with(tmp_path, poisoned)
