"""DSpark, V4.1's drafter: its drafts against a second implementation written from DeepSeek's reference
(`dspark_reference.py`: fp32, no cache, the whole context recomputed each step), over decode steps of
several requests, after rollbacks and after a prefix hit; the non-causal block and the context window
on hand-checked positions; the Markov bias reading the previous slot's draft; the taps recorded only
when a drafter is attached; the `mtp.*` weights loaded as released."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.config import CheckpointError
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.dspark_weights import load_dspark_weights
from deepinfer_core.models.v41_tiny import tiny_v41_dspark_config, write_v41_checkpoint
from deepinfer_core.speculative.dspark_drafter import build_dspark_drafter, context_visibility
from deepinfer_core.speculative.mtp_drafter import DraftTarget
from deepinfer_core.speculative.proposer import StoredDrafter
from tests.models.dspark_reference import ReferenceDSpark
from tests.models.v41_helpers import dspark_checkpoint, make_engine, random_prompt, run


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory, weights = dspark_checkpoint(tmp_path_factory)
    return directory, weights, V41Config.from_dir(directory)


@pytest.fixture(scope="module")
def reference(checkpoint):
    directory, weights, config = checkpoint
    dspark = load_dspark_weights(directory, config, torch.float32, "cpu")
    return ReferenceDSpark(config, {**dspark, "embed.weight": weights["embed.weight"], "head.weight": weights["head.weight"]})


@pytest.fixture(scope="module")
def cold(checkpoint):
    """An engine whose runs record the taps (one request at a time, no prefix cache)."""
    engine = make_engine(checkpoint[0], checkpoint[1], max_num_seqs=1, num_kv_blocks=8)
    engine.runner.model.keeps_final_streams = True
    return engine


class Recorder:
    """Stands in the runner's drafter slot: runs the DSpark drafter after every step and records each
    proposal with the request and the last context position it drafted after; with `verify` the
    proposals go to the engine as drafts (verified through a `StoredDrafter`), else nowhere."""

    reads_every_step = True

    def __init__(self, drafter, verify: bool) -> None:
        self.drafter, self.verify, self.proposals = drafter, verify, []

    def draft_probs(self, plan):
        return {}

    def propose(self, plan, states, input_ids, taps, result):
        proposals = self.drafter.propose(plan, states, input_ids, taps, result)
        if proposals is not None:
            for (request_id, last), proposal in zip(self.drafter.last_proposed, proposals, strict=True):
                self.proposals.append((request_id, last, proposal))
        return proposals if self.verify else None


def attach(engine, directory, k: int = 3) -> Recorder:
    """The DSpark drafter in `engine`'s runner; its drafts are verified when the engine speculates."""
    runner = engine.runner
    target = DraftTarget(runner.config, runner.inputs.make_context, runner.sampler, runner.num_slots, runner.dtype,
                         runner.device)
    options = SimpleNamespace(model=str(directory), quantized_weights="native",  # the default: FP8 as the target's
                              speculative_config=SimpleNamespace(num_speculative_tokens=k))
    drafter = build_dspark_drafter(options, target, runner.model, runner.parallel, runner.plans[0].moe, False)
    if engine.speculator is not None:
        engine.speculator.drafter = StoredDrafter()
    runner.mtp = Recorder(drafter, verify=engine.speculator is not None)
    return runner.mtp


def full_taps(cold, tokens: list[int]) -> torch.Tensor:
    """The taps of every position of `tokens`, from one cold prefill."""
    run(cold, [tokens], [1])
    return cold.runner.model.final_streams.clone()


def check_against_reference(cold, reference, recorder, sequences: dict[str, list[int]], k: int) -> int:
    """Every recorded proposal equals the reference's over the request's final tokens; returns how many."""
    taps = {request_id: full_taps(cold, tokens) for request_id, tokens in sequences.items()}
    for request_id, last, (tokens, confidences) in recorder.proposals:
        sequence = sequences[request_id]
        want_tokens, want_confidences = reference.draft(taps[request_id][: last + 1], sequence[last + 1], k)
        assert tokens == want_tokens, (request_id, last)
        assert confidences == pytest.approx(want_confidences, abs=1e-5), (request_id, last)
    return len(recorder.proposals)


def test_drafts_equal_the_reference_over_decode_steps_of_several_requests(checkpoint, reference, cold):
    engine = make_engine(checkpoint[0], checkpoint[1], max_num_seqs=3, max_num_batched_tokens=16)
    recorder = attach(engine, checkpoint[0], k=3)
    prompts = [random_prompt(n, seed=n) for n in (5, 13, 22)]  # shorter and longer than the window (8)
    outputs = run(engine, prompts, 20)
    sequences = {str(i): p + o.outputs[0].token_ids for i, (p, o) in enumerate(zip(prompts, outputs))}
    assert check_against_reference(cold, reference, recorder, sequences, 3) == 3 * 20


def test_drafts_equal_the_reference_after_rollbacks_and_a_prefix_hit(checkpoint, reference, cold):
    """DSpark's drafts verified (rejected ones rolled back: the rings hold only final positions), and a
    request hitting another's cached block, the window below the hit replayed."""
    shared, suffix = random_prompt(128, seed=42), random_prompt(10, seed=43)
    engine = make_engine(checkpoint[0], checkpoint[1], max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=6,
                         enable_prefix_caching=True, swa_replay="exact",
                         speculative_config={"method": "ngram", "num_speculative_tokens": 1,
                                             "draft_length_policy": "fixed"})
    recorder = attach(engine, checkpoint[0], k=3)
    first = run(engine, [shared + [9, 9]], [6])[0]
    split = len(recorder.proposals)  # request ids restart at "0" per run: the second run's are relabelled
    outputs = run(engine, [shared + suffix], [12])  # hits the first request's block, replays below it
    assert outputs[0].num_cached_tokens == 128
    stats = engine.stats()
    assert stats["spec_verified_tokens"] > stats["spec_accepted_tokens"]  # drafts were rejected, rolled back
    sequences = {"0": shared + [9, 9] + first.outputs[0].token_ids,
                 "1": shared + suffix + outputs[0].outputs[0].token_ids}
    proposals = recorder.proposals
    recorder.proposals = proposals[:split] + [("1", last, p) for _, last, p in proposals[split:]]
    assert check_against_reference(cold, reference, recorder, sequences, 3) >= 6 + 12 - 2


# ---------------------------------------------------------------------- hand-checked positions


def test_the_context_window_on_hand_checked_positions():
    # window 4, last context position 10: ring slot j holds position 10 - ((10 - j) % 4) = 8, 9, 10, 7
    held, visible = context_visibility(torch.tensor([10, 2, 10]), torch.tensor([0, 0, 9]), 4)
    assert held.tolist() == [[8, 9, 10, 7], [0, 1, 2, -1], [8, 9, 10, 7]]
    # (p - 4, p] = 7..10; before position 0 nothing; rows before the request's first (9) are someone else's
    assert visible.tolist() == [[True] * 4, [True, True, True, False], [False, True, True, False]]


def test_the_block_is_non_causal_and_sees_only_its_context_window(checkpoint):
    directory, weights, config = checkpoint
    engine = make_engine(directory, weights, max_num_seqs=1)
    module = attach(engine, directory).drafter.module
    w, bs = module.window, module.block_size
    generator = torch.Generator().manual_seed(0)
    context = [torch.randn(1, w, config.head_dim, generator=generator) for _ in module.mtp]
    visible = torch.ones(1, w, dtype=torch.bool)
    visible[0, 2] = False
    anchors, last = torch.tensor([77]), torch.tensor([20])
    hidden = module.block(anchors, last, context, visible)[0]
    # a ring row the block must not see changes nothing
    hidden_ctx = [c.clone() for c in context]
    hidden_ctx[0][0, 2] += 5.0
    assert torch.equal(module.block(anchors, last, hidden_ctx, visible)[0], hidden)
    # a row it sees changes every slot
    hidden_ctx[0][0, 3] += 5.0
    changed = module.block(anchors, last, hidden_ctx, visible)[0]
    assert all(not torch.allclose(changed[0, i], hidden[0, i]) for i in range(bs))
    # slot 0 (the anchor) sees the noise slots after it: the block attends in both directions
    embed = module.target.embed.weight.data
    saved = embed[config.dspark_noise_token_id].clone()
    embed[config.dspark_noise_token_id] += 1.0
    try:
        assert not torch.allclose(module.block(anchors, last, context, visible)[0][0, 0], hidden[0, 0])
    finally:
        embed[config.dspark_noise_token_id] = saved


def test_each_slots_markov_bias_reads_the_previous_slots_draft(checkpoint):
    directory, weights, _ = checkpoint
    engine = make_engine(directory, weights, max_num_seqs=2)
    drafter = attach(engine, directory, k=4).drafter
    seen, markov = [], drafter.module.markov

    def spy(prev):
        seen.append(prev.tolist())
        return markov(prev)

    drafter.module.markov = spy
    prompts = [random_prompt(9, seed=1), random_prompt(11, seed=2)]
    run(engine, prompts, [2, 2])
    proposals = engine.runner.mtp.proposals
    steps = len(seen) // 4
    assert steps == 2 and len(proposals) == 4
    for step in range(steps):
        inputs, drafts = seen[4 * step : 4 * step + 4], [p[2][0] for p in proposals[2 * step : 2 * step + 2]]
        for slot in range(1, 4):
            assert inputs[slot] == [d[slot - 1] for d in drafts]


def test_confidences_are_the_raw_projection_not_a_probability(checkpoint, reference):
    engine = make_engine(checkpoint[0], checkpoint[1], max_num_seqs=1)
    recorder = attach(engine, checkpoint[0], k=5)
    run(engine, [random_prompt(12, seed=8)], [3])
    values = [c for _, _, (_, confidences) in recorder.proposals for c in confidences]
    assert len(values) == 15 and any(not 0 < c < 1 for c in values)  # a sigmoid would keep them in (0, 1)


# ---------------------------------------------------------------------- taps and weights


def test_taps_are_recorded_only_with_a_drafter_attached(checkpoint, cold):
    engine = make_engine(checkpoint[0], checkpoint[1], max_num_seqs=1)
    run(engine, [random_prompt(6, seed=1)], [2])
    assert engine.runner.model.final_streams is None
    taps = full_taps(cold, random_prompt(6, seed=1))
    assert taps.shape == (6, 3 * checkpoint[2].hidden_size)


def test_missing_dspark_tensors_are_a_clear_error(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = checkpoint[0]
    tensors = {k: v for k, v in load_file(directory / "model.safetensors").items() if not k.startswith("mtp.2.")}
    target = write_v41_checkpoint(tmp_path / "no-dspark", tiny_v41_dspark_config(), tensors=tensors)
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(CheckpointError, match="no complete DSpark drafter"):
        load_dspark_weights(target, checkpoint[2], torch.float32, "cpu")


def test_fp4_experts_are_kept_packed_as_the_targets_and_draft_as_dequantised(checkpoint):
    """`quantized_weights="native"` keeps the stages' FP4 experts packed, as the target's: the block's
    outputs equal those of the dequantised experts (FP4 dequantises exactly)."""
    from deepinfer_core import plugins
    from deepinfer_core.models.deepseek_v41.dspark_weights import build_dspark

    directory, weights, config = checkpoint
    engine = make_engine(directory, weights, max_num_seqs=1)
    outputs = []
    for fmt in ("fp4", "dense"):
        module = build_dspark(config, torch.float32, load_dspark_weights(directory, config, torch.float32, "cpu",
                                                                       keep_fp4=fmt == "fp4"), "cpu", fmt)
        assert (module.mtp[0].ffn.experts.gate_up_proj.dtype == torch.int8) == (fmt == "fp4")
        module.bind(engine.runner.model, [plugins.make_moe(module.plans[0].moe, torch.device("cpu"))] * 3)
        context = [torch.randn(1, module.window, config.head_dim, generator=torch.Generator().manual_seed(1))
                   for _ in module.mtp]
        outputs.append(module.block(torch.tensor([5]), torch.tensor([30]), context, torch.ones(1, module.window,
                                                                                               dtype=torch.bool))[1])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def test_drafts_after_steps_that_asked_for_none_equal_the_reference(checkpoint, reference, cold):
    """Under the confidence policy DSpark's random drafts stop paying, so steps stop asking for drafts
    (`StepPlan.propose_drafts` False): the windows are still written, and the drafts of a later probe
    equal the reference's."""
    engine = make_engine(checkpoint[0], checkpoint[1], max_num_seqs=2,
                         speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    drafter, recorded, paused = engine.runner.mtp, SimpleNamespace(proposals=[]), []
    draft, propose = drafter._draft, drafter.propose

    def spy_draft(plan, states, sampled, anchors):
        proposals = draft(plan, states, sampled, anchors)
        recorded.proposals += [(r, last, p) for (r, last), p in zip(drafter.last_proposed, proposals, strict=True)]
        return proposals

    def spy_propose(plan, *args):
        if not plan.propose_drafts and any(r.is_sampled for r in plan.requests):
            paused.append(len(recorded.proposals))  # proposals made before this paused step
        return propose(plan, *args)

    drafter._draft, drafter.propose = spy_draft, spy_propose
    prompts = [random_prompt(n, seed=n) for n in (6, 11)]
    outputs = run(engine, prompts, 24)
    assert paused, "no step stopped asking for drafts"
    assert len(recorded.proposals) > paused[0], "no probe drafted after a pause"
    sequences = {str(i): p + o.outputs[0].token_ids for i, (p, o) in enumerate(zip(prompts, outputs))}
    assert check_against_reference(cold, reference, recorded, sequences, 3) > 0
