"""Penalties read each request's own ids: the plan hands them to the runner, and the engine's greedy
tokens equal the oracle's logits with vLLM's penalties applied by hand, through chunking, preemption
and alongside requests without penalties."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.plan import PENDING_TOKEN
from deepinfer_core.testing.serving import serve
from tests.engine.test_engine import CONFIG, make_engine, random_prompts
from tests.oracle import hf_model, random_state_dict

WEIGHTS = random_state_dict(CONFIG, seed=11)


@pytest.fixture(scope="module")
def oracle():
    return hf_model(CONFIG, WEIGHTS)


@torch.no_grad()
def penalised_greedy(model, prompt, max_tokens, presence=0.0, frequency=0.0, repetition=1.0):
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        out = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long), minlength=logits.numel()).float()
        seen = (out > 0) | (torch.bincount(torch.tensor(prompt), minlength=logits.numel()) > 0)
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
        logits = logits - frequency * out - presence * (out > 0)
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalised_greedy_equals_the_oracle_under_chunking_and_preemption(tmp_path, oracle, async_scheduling):
    prompts = random_prompts([40, 126, 200, 9], seed=5)
    penalties = [{"presence": 1.5}, {"frequency": 0.8}, {"repetition": 1.8}, {}]
    engine = make_engine(tmp_path, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=4,
                         async_scheduling=async_scheduling)
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty", "repetition": "repetition_penalty"}
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **{names[k]: v for k, v in pen.items()})
              for pen in penalties]
    plans, execute_model = [], engine.executor.execute_model  # every step's first phase sees its plan
    engine.executor.execute_model = lambda plan: plans.append(plan) or execute_model(plan)
    done = {out.request_id: out for out in serve(engine, prompts, params)}
    assert engine.stats()["num_preemptions"] > 0, "the pool was meant to force a readmission"
    pending = [r for plan in plans for r in plan.requests if PENDING_TOKEN in r.token_ids]
    assert all(r.request_id == "3" for r in pending)  # a penalised request's input is never left on the device
    if async_scheduling:  # ... but the plain request beside them still decodes overlapped
        assert len(pending) >= 3
    for i, (prompt, pen) in enumerate(zip(prompts, penalties)):
        assert done[str(i)].outputs[0].token_ids == penalised_greedy(oracle, prompt, 12, **pen), i
    plain = penalised_greedy(oracle, prompts[0], 12)
    assert done["0"].outputs[0].token_ids != plain, "the presence penalty was meant to change the output"
