"""The oracle: transformers' `DeepseekV4ForCausalLM` (fp32, CPU) on the same weights as the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.plan import NewRequest, ScheduledRequest, StepPlan
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config
from deepinfer_core.testing.serving import serve
from deepinfer_core.worker.runner import ModelRunner

transformers = __import__("pytest").importorskip("transformers", minversion="5.23")


def parity_config(preset: str, **overrides) -> dict:
    # 32 indexer heads: a score is exactly 0 only when every head's ReLU is 0, and with few heads such
    # ties at the top-k boundary are common; tied picks depend on each implementation's tie order.
    return tiny_config(preset, **{"index_n_heads": 32, **overrides})


def hf_model(config: dict, weights: dict[str, torch.Tensor]):
    hf_config = transformers.DeepseekV4Config(**ModelConfig.from_dict(config).to_hf_dict())
    model = transformers.DeepseekV4ForCausalLM(hf_config).eval()
    model.load_state_dict(weights, strict=True)
    return model


@torch.no_grad()
def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """Log-softmax of the oracle's logits at every position of one unpadded sequence."""
    return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation and the chosen tokens' logprobs, by full forwards (no cache)."""
    ids, lps = list(prompt), []
    for _ in range(max_tokens):
        lp = hf_logprobs(model, ids)[-1]
        token = int(lp.argmax())
        ids.append(token)
        lps.append(float(lp[token]))
    return ids[len(prompt):], lps


def greedy_tokens_and_logprobs(engine, batch: list[list[int]], num_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Greedy `(token ids, chosen-token logprobs)` of every prompt of `batch`, in order, through `engine`."""
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=0)
    outs = [out.outputs[0] for out in serve(engine, batch, params)]
    return [(out.token_ids, [step[t].logprob for step, t in zip(out.logprobs, out.token_ids)]) for out in outs]


def write_config(directory: Path, config: dict) -> Path:
    (directory / "config.json").write_text(json.dumps(config))
    return directory


_FAKE_IDS = count()


@dataclass
class FakeSeq:
    """A request as model tests drive the runner directly: `step_plan` turns a list of them into the plan
    the scheduler would send."""

    token_ids: list[int]
    slot: int
    block_table: list[int]
    num_computed_tokens: int = 0
    replay_start: int = 0
    no_write_before: int = 0
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"fake{next(_FAKE_IDS)}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)


def make_runner(tmp_path: Path, config: dict, weights, num_slots=8, num_blocks=64) -> ModelRunner:
    write_config(tmp_path, config)
    engine_config = EngineConfig(model=str(tmp_path), dtype="float32", max_num_seqs=num_slots, num_kv_blocks=num_blocks)
    model_config = ModelConfig.from_dict(config)
    return ModelRunner(model_config, engine_config.resolve(model_config), torch.device("cpu"), weights=weights)


def step_plan(runner: ModelRunner, seqs: list[FakeSeq], num_new: list[int]) -> StepPlan:
    """The plan computing `num_new[i]` tokens of `seqs[i]`; requests the runner does not know are new."""
    new, requests = [], []
    for seq, n in zip(seqs, num_new):
        known = runner.requests.get(seq.request_id)
        if known is None:
            new.append(NewRequest(seq.request_id, seq.slot, tuple(seq.block_table), seq.num_prompt_tokens,
                                  seq.sampling_params, 0))
        start = seq.num_computed_tokens
        requests.append(ScheduledRequest(
            seq.request_id, start, tuple(seq.token_ids[start : start + n]), start + n == seq.num_tokens,
            tuple(seq.block_table[len(known.block_table) :]) if known else (), seq.replay_start, seq.no_write_before,
        ))
    return StepPlan(tuple(requests), tuple(new))


def all_position_logprobs(runner: ModelRunner, seqs: list[FakeSeq], num_new: list[int]) -> list[torch.Tensor]:
    """Run one step and return, per sequence, the logprobs at each of its computed positions."""
    plan = step_plan(runner, seqs, num_new)
    ctx = runner.prepare_inputs(plan, runner.update_states(plan))[0]
    logits = runner.model(ctx, runner.kv_cache.layers, torch.arange(sum(num_new), device=runner.device))
    out, offset = [], 0
    for seq, n in zip(seqs, num_new):
        out.append(logits[offset : offset + n].log_softmax(-1))
        offset += n
        seq.num_computed_tokens += n
    return out


def run_chunked(runner, prompts: list[list[int]], chunk: int) -> list[torch.Tensor]:
    """Feed all prompts together, `chunk` tokens per request per step; collect every position."""
    seqs = [FakeSeq(p, slot=i, block_table=list(range(8 * i, 8 * i + 8))) for i, p in enumerate(prompts)]
    got = [[] for _ in seqs]
    while any(s.num_computed_tokens < s.num_tokens for s in seqs):
        live = [(i, s) for i, s in enumerate(seqs) if s.num_computed_tokens < s.num_tokens]
        num_new = [min(chunk, s.num_tokens - s.num_computed_tokens) for _, s in live]
        for (i, _), lp in zip(live, all_position_logprobs(runner, [s for _, s in live], num_new)):
            got[i].append(lp.cpu())
    return [torch.cat(g) for g in got]


__all__ = ["parity_config", "random_state_dict"]
