"""A prefill split over two context-parallel ranks leaves the single-rank prefill's cache on both ranks."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_core import SamplingParams
from deepinfer_core.backends.parallel import build_groups
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.plan import NewRequest, ScheduledRequest, StepPlan
from deepinfer_core.worker.runner import ModelRunner
from tests.oracle import parity_config, random_state_dict, write_config

CONFIG = parity_config("hca128")  # sliding window 16, CSA rate 4, HCA rate 128
LONG = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(2, 500, (n,), generator=LONG).tolist() for n in (420, 45, 3, 70)]


def plans() -> list[StepPlan]:
    """Prefill of a 420-token prompt (more than three HCA windows) in chunks of 160 beside short ones,
    with prompt logprobs on one; a decode step (run whole); then a new prompt prefilled beside decodes."""
    params = [SamplingParams(temperature=0, prompt_logprobs=2 if i == 1 else None) for i in range(4)]
    new = [NewRequest(f"r{i}", i, tuple(range(5 * i, 5 * i + 5)), len(p), params[i], i) for i, p in enumerate(PROMPTS)]

    def chunk(i, start, stop, sampled=False):
        return ScheduledRequest(f"r{i}", start, tuple(PROMPTS[i][start:stop]), sampled)

    def decode(i, position):
        return ScheduledRequest(f"r{i}", position, (7 + i,), True)

    return [
        StepPlan((chunk(0, 0, 160), chunk(1, 0, 45, True), chunk(2, 0, 3, True)), tuple(new[:3])),
        StepPlan((chunk(0, 160, 320), decode(1, 45), decode(2, 3))),
        StepPlan((chunk(0, 320, 420, True), decode(1, 46), decode(2, 4))),
        StepPlan((decode(0, 420), decode(1, 47), decode(2, 5))),  # all decodes: not split
        StepPlan((decode(0, 421), decode(1, 48), chunk(3, 0, 70, True)), (new[3],)),
    ]


def run(runner: ModelRunner) -> tuple[list, int]:
    """Every step's sampled tokens and prompt logits, and how many steps were split."""
    outputs, num_split = [], 0
    for plan in plans():
        if runner.context_parallel is not None:
            layout = runner.context_parallel.layout(plan, runner.update_states(plan))
            num_split += layout is not None
            plan = StepPlan(plan.requests)  # admitted just now
        result = runner.execute(plan)
        outputs.append((result.sampled, result.output.token_ids.tolist(),
                        {i: logits for i, (_, logits) in result.prompt_logits.items()}))
    return outputs, num_split


def make_runner(directory, rank: int | None = None) -> ModelRunner:
    """The single-rank runner, or (with `rank`) one of two context-parallel ranks."""
    write_config(Path(directory), CONFIG)
    options = {"context_parallel_size": 2} if rank is not None else {}
    engine_config = EngineConfig(model=str(directory), dtype="float32", max_num_seqs=4, num_kv_blocks=20, **options)
    model_config = ModelConfig.from_dict(CONFIG)
    groups = build_groups(engine_config.parallel_config, rank) if rank is not None else None
    return ModelRunner(model_config, engine_config.resolve(model_config), torch.device("cpu"),
                       weights=random_state_dict(CONFIG, seed=3), parallel=groups)


def cache_tensors(runner: ModelRunner) -> dict[str, torch.Tensor]:
    return {f"{i}.{f.name}": getattr(layer, f.name).clone() for i, layer in enumerate(runner.kv_cache.layers)
            for f in fields(layer) if getattr(layer, f.name) is not None}


def _rank(rank: int, init_file: str, directory: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        runner = make_runner(directory, rank)
        outputs, num_split = run(runner)
        torch.save({"outputs": outputs, "num_split": num_split, "cache": cache_tensors(runner)},
                   f"{directory}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_context_parallel_ranks_hold_the_single_rank_cache(tmp_path):
    (tmp_path / "cp").mkdir()
    mp.spawn(_rank, args=(str(tmp_path / "init"), str(tmp_path / "cp")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / "cp" / f"rank{r}.pt") for r in range(2)]
    single = make_runner(tmp_path)
    want_outputs, _ = run(single)
    want_cache = cache_tensors(single)

    assert ranks[0]["num_split"] == ranks[1]["num_split"] == 4  # every step with a prefill chunk
    for name, want in want_cache.items():
        # both ranks hold the same cache, bit for bit (every value was computed once and copied) ...
        assert torch.equal(ranks[0]["cache"][name], ranks[1]["cache"][name]), name
        # ... which is the single-rank prefill's, up to fp32 rounding
        torch.testing.assert_close(ranks[0]["cache"][name], want, rtol=0, atol=1e-5, msg=name)
    for rank in ranks:
        for (sampled, tokens, prompt), (want_sampled, want_tokens, want_prompt) in zip(rank["outputs"], want_outputs):
            assert (sampled, tokens) == (want_sampled, want_tokens)
            assert prompt.keys() == want_prompt.keys()
            for i in want_prompt:
                torch.testing.assert_close(prompt[i], want_prompt[i], rtol=0, atol=1e-5)
