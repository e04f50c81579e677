"""DeepSeek-V4.1's decoder-side trimming (`models/v41_trim.py`) on the tiny model: its trim point is layer 5
(the candidate source) and its window 8, so a request keeps its prompt's last 8 rows past layer 5.

The trimmed forward is the untrimmed layers on every row then the later ones on the kept rows, by hand;
the state up to the trim point's compressor is the untrimmed run's; prompt-logprob requests and short
prompts are never trimmed; a batch equals each request alone; chunked prefill, preemption and a prefix
hit (exact replay) give one-shot prefill's outputs; off by default, and refused where it cannot hold."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.backends import AttentionMetadata
from deepinfer_core.config import ConfigError, EngineConfig
from deepinfer_core.models.deepseek_v4 import row_trim
from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.interface import ForwardContext
from deepinfer_core.models.v41_tiny import tiny_v41_config
from deepinfer_core.reference.layer_ops import hyper_residual
from tests.models.v41_helpers import make_engine, make_runner, random_prompt, run, tiny_checkpoint
from tests.oracle import FakeSeq, step_plan

TRIM_LAYER, WINDOW = 5, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def chosen_logprobs(output) -> list[float]:
    completion = output.outputs[0]
    return [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]


def assert_same_answers(mine, theirs, tolerance: float) -> None:
    for a, b in zip(mine, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x - y) for x, y in zip(chosen_logprobs(a), chosen_logprobs(b))) <= tolerance


# ------------------------------------------------------------------------------------------------ the model


LENGTHS = (23, 30)  # one step, both whole: the first kept positions are 15 and 22


def one_step(runner, prompts):
    """The step's `ForwardContext` (both prompts whole) and its logits rows (each prompt's last row)."""
    seqs = [FakeSeq(p, slot=i, block_table=[2 * i]) for i, p in enumerate(prompts)]
    plan = step_plan(runner, seqs, [len(p) for p in prompts])
    ctx, logits_rows = runner.prepare_inputs(plan, runner.update_states(plan))[:2]
    return ctx, logits_rows


def kept_context(model, ctx: ForwardContext) -> tuple[torch.Tensor, ForwardContext]:
    """The kept rows of `one_step`'s context and the context of only them, written out by hand."""
    (a, b), (keep_a, keep_b) = LENGTHS, (LENGTHS[0] - WINDOW, LENGTHS[1] - WINDOW)
    rows = torch.cat((torch.arange(keep_a, a), a + torch.arange(keep_b, b)))
    positions = torch.cat((torch.arange(keep_a, a), torch.arange(keep_b, b)))
    meta = ctx.metadata
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, WINDOW, 2 * WINDOW]), start_positions=torch.tensor([keep_a, keep_b]),
        positions=positions, slots=meta.slots, block_tables=meta.block_tables, query_lens=[WINDOW, WINDOW],
        start_positions_host=[keep_a, keep_b], window_start_positions_host=[keep_a, keep_b],
        window_starts=torch.tensor([keep_a, keep_b]), max_seq_len=b)
    kept = ForwardContext(metadata=metadata, input_ids=ctx.input_ids[rows], rope=model.rope_tables(positions),
                          num_entries=ctx.num_entries, no_write_before=ctx.no_write_before)
    return rows, kept


@torch.inference_mode()
def trimmed_by_hand(model, ctx: ForwardContext, caches) -> torch.Tensor:
    """Every layer up to the trim point's compressor on all rows, the rest on the kept rows: the last
    row of each request's logits."""
    hashes = model.engram_hashes(ctx, caches, None)
    x = model.embed(ctx.input_ids)
    streams = x.unsqueeze(1).repeat(1, model.hc_mult, 1)
    pre = torch.zeros(x.shape[0], model.hc_mult)
    pre[:, 0] = 1.0
    mixing, shared, pending = model.ops, {}, None
    for i, (block, plan) in enumerate(zip(model.layers, model.plans)):
        if pending is not None and not plan.has_engram:
            streams, pre_a, post_a, comb_a, x = mixing.hc_post_mix(streams, *pending, model.hc[i][0],
                                                                  block.attn_norm.weight, pre)
        else:
            if pending is not None:
                streams = hyper_residual(streams, *pending)
            if plan.has_engram:
                streams = model.engram(i, streams, hashes, None)
            pre_a, post_a, comb_a, x = mixing.hc_mix(streams, model.hc[i][0], block.attn_norm.weight, pre)
        if i == TRIM_LAYER:
            model.compress(i, x, ctx, caches[i])
            rows, ctx = kept_context(model, ctx)
            streams, pre_a, post_a, comb_a, x = (t[rows] for t in (streams, pre_a, post_a, comb_a, x))
            shared = {key: value[rows] for key, value in shared.items()}
        out = model.attention(i, x, ctx, caches[i], shared, compress=i != TRIM_LAYER)
        streams, pre, post_f, comb_f, x = mixing.hc_post_mix(streams, out, post_a, comb_a, model.hc[i][1],
                                                             block.ffn_norm.weight, pre_a)
        pending = (model.moe(i, x, ctx, None), post_f, comb_f)
    last = torch.tensor([WINDOW - 1, 2 * WINDOW - 1])
    return model.ops.map_rows(model.head_logits, *(t[last] for t in (streams, *pending, pre)))


def test_the_trim_point_is_the_candidate_source_and_llm_takes_the_option(checkpoint):
    llm = LLM(model=str(checkpoint[0]), dtype="float32", max_num_seqs=1, num_kv_blocks=2, decoder_trimming=True)
    runner = llm.engine.runner
    assert runner.model.trim_layer == TRIM_LAYER == runner.model.config.candidate_source_layer_id
    assert runner.num_trim_kept == WINDOW == runner.model.config.sliding_window


def test_which_steps_are_trimmed_from_where(checkpoint):
    """A request keeps its prompt's last window (`keep_from` 22 of 30 here) in every chunk that has a row
    whose window reaches below 22; its decode steps, and a request asking for prompt logprobs, never trim."""
    runner = make_runner(*checkpoint, decoder_trimming=True)
    plain = FakeSeq(random_prompt(30, seed=3), slot=0, block_table=[0])
    logprobs = FakeSeq(random_prompt(30, seed=4), slot=1, block_table=[1],
                       sampling_params=SamplingParams(prompt_logprobs=1))

    def keep_from(seqs, num_new):
        plan = step_plan(runner, seqs, num_new)
        ctx = runner.prepare_inputs(plan, runner.update_states(plan))[0]
        for seq, n in zip(seqs, num_new):
            seq.num_computed_tokens += n
        return ctx.keep_from

    assert keep_from([plain, logprobs], [10, 10]) == [22, 0]  # rows 0-9 of `plain` stop at the trim point
    assert keep_from([plain, logprobs], [15, 20]) == [22, 0]  # `plain` keeps rows 22-24
    assert keep_from([plain], [5]) == [22]  # nothing dropped, but the window of position 25 reaches 18
    plain.token_ids.append(7)
    assert keep_from([plain], [1]) is None  # decode
    assert keep_from([FakeSeq(random_prompt(WINDOW, seed=5), slot=2, block_table=[2])], [WINDOW]) is None


def test_the_trimmed_forward_is_every_row_to_the_trim_point_then_the_kept_rows(checkpoint):
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    trimmed = make_runner(*checkpoint, decoder_trimming=True)
    ctx, logits_rows = one_step(trimmed, prompts)
    assert ctx.keep_from == [LENGTHS[0] - WINDOW, LENGTHS[1] - WINDOW]
    mine = trimmed.model(ctx, trimmed.kv_cache.layers, logits_rows)

    by_hand = make_runner(*checkpoint)
    ctx, logits_rows = one_step(by_hand, prompts)
    assert ctx.keep_from is None and logits_rows.tolist() == [LENGTHS[0] - 1, sum(LENGTHS) - 1]
    expected = trimmed_by_hand(by_hand.model, ctx, by_hand.kv_cache.layers)
    assert torch.equal(mine, expected)

    untrimmed = make_runner(*checkpoint)
    ctx, logits_rows = one_step(untrimmed, prompts)
    full = untrimmed.model(ctx, untrimmed.kv_cache.layers, logits_rows)
    assert (full.log_softmax(-1) - mine.log_softmax(-1)).abs().max().item() > 1e-3  # trimming did something


def test_the_state_up_to_the_trim_points_compressor_is_the_untrimmed_runs(checkpoint):
    prompts = [random_prompt(n, seed=n) for n in LENGTHS]
    runners = [make_runner(*checkpoint, decoder_trimming=trim) for trim in (True, False)]
    for runner in runners:
        ctx, logits_rows = one_step(runner, prompts)
        runner.model(ctx, runner.kv_cache.layers, logits_rows)
    trimmed, untrimmed = (r.kv_cache.layers for r in runners)
    for i, (mine, theirs) in enumerate(zip(trimmed, untrimmed)):
        for name in ("compressed", "index_keys", "kv_tail", "gate_tail", "token_ids"):
            a, b = getattr(mine, name), getattr(theirs, name)
            assert (a is None) == (b is None)
            if a is not None:  # written by layers <= the trim point, for every row (later layers share them)
                assert torch.equal(a, b), (i, name)
        if i < TRIM_LAYER:
            assert torch.equal(mine.window, theirs.window), i
        elif i == TRIM_LAYER:  # the kept rows' keys from the same inputs (a matmul over fewer rows: last bits)
            assert torch.allclose(mine.window, theirs.window, rtol=0, atol=1e-5)
        else:  # later windows: keys of kept rows that saw fewer rows after the trim point
            assert not torch.allclose(mine.window, theirs.window, rtol=0, atol=1e-3), i


# ------------------------------------------------------------------------------------------------ the engine


def test_prompt_logprob_requests_and_short_prompts_are_never_trimmed(checkpoint):
    long_prompt, short = random_prompt(37, seed=1), random_prompt(WINDOW, seed=2)
    outputs = []
    for trim in (True, False):
        engine = make_engine(*checkpoint, decoder_trimming=trim, max_num_batched_tokens=16)
        outputs.append(run(engine, [long_prompt], 4, prompt_logprobs=1) + run(engine, [short], 4))
    (trimmed_long, trimmed_short), (full_long, full_short) = outputs
    assert_same_answers([trimmed_long, trimmed_short], [full_long, full_short], tolerance=0.0)
    mine, theirs = trimmed_long.prompt_logprobs, full_long.prompt_logprobs
    assert len(mine) == 37 and mine[1:] == theirs[1:]


def test_trimming_is_off_by_default_and_leaves_the_untrimmed_path_alone(checkpoint, monkeypatch):
    assert EngineConfig(model=str(checkpoint[0])).decoder_trimming is False

    def refuse(ctx, keep_from):
        raise AssertionError("trimmed with decoder_trimming off")

    monkeypatch.setattr(row_trim.TrimmedStep, "build", refuse)
    engine = make_engine(*checkpoint, max_num_batched_tokens=16)
    assert engine.runner.model.trim_layer is None
    outputs = run(engine, [random_prompt(37, seed=1)], 2)
    assert len(outputs[0].outputs[0].token_ids) == 2


BATCH = (5, 19, 26, 41)  # shorter than a window, one window and more, several windows and candidate pools


@pytest.fixture(scope="module")
def alone(checkpoint):
    """Each of `BATCH`'s prompts alone, one-shot prefill, trimmed."""
    engine = make_engine(*checkpoint, decoder_trimming=True, max_num_seqs=1)
    return [run(engine, [random_prompt(n, seed=n)], 6)[0] for n in BATCH]


def test_trimming_changes_the_outputs_of_prompts_longer_than_a_window(checkpoint, alone):
    engine = make_engine(*checkpoint, max_num_seqs=1)
    untrimmed = [run(engine, [random_prompt(n, seed=n)], 6)[0] for n in BATCH]
    for n, mine, theirs in zip(BATCH, alone, untrimmed):
        difference = max(abs(x - y) for x, y in zip(chosen_logprobs(mine), chosen_logprobs(theirs)))
        assert (difference == 0) == (n <= WINDOW), n


@pytest.mark.parametrize("budget", [None, 7, 13])  # one shot; chunks that end before, across and after
def test_a_batch_chunked_or_not_equals_each_request_alone(checkpoint, alone, budget):
    """With chunked prefill a request keeps the same positions as in one shot (its prompt's last window on):
    a chunk that ends before them runs no row past the trim point, and kept rows in a later chunk see the
    earlier chunk's kept rows in their window, never a position before the first kept one."""
    engine = make_engine(*checkpoint, decoder_trimming=True, **({"max_num_batched_tokens": budget} if budget else {}))
    together = run(engine, [random_prompt(n, seed=n) for n in BATCH], 6)
    assert_same_answers(together, alone, tolerance=1e-4)


def test_deterministic_mode_keeps_batches_and_chunks_bit_for_bit_with_trimming(checkpoint):
    prompts = [random_prompt(n, seed=n) for n in BATCH[2:]]
    options = {"decoder_trimming": True, "deterministic": True}
    alone = [run(make_engine(*checkpoint, max_num_seqs=1, **options), [p], 3)[0] for p in prompts]
    chunked = run(make_engine(*checkpoint, max_num_batched_tokens=7, **options), prompts, 3)
    assert_same_answers(chunked, alone, tolerance=0.0)


def test_preemption_changes_nothing(checkpoint):
    """A preempted request recomputes prompt and generated tokens; the kept positions still start at its
    prompt's last window, so the later layers see what they saw before."""
    lengths, max_tokens = (118, 121, 124, 126), 12  # all decode across the block edge on a 5-block pool
    prompts = [random_prompt(n, seed=n) for n in lengths]
    options = {"decoder_trimming": True, "max_num_batched_tokens": 93}
    alone = [run(make_engine(*checkpoint, max_num_seqs=1, **options), [p], max_tokens)[0] for p in prompts]
    engine = make_engine(*checkpoint, max_num_seqs=4, num_kv_blocks=5, **options)
    together = run(engine, prompts, max_tokens)
    assert engine.stats()["num_preemptions"] > 0, "the pool was meant to force preemption"
    assert_same_answers(together, alone, tolerance=1e-4)


SHARED, SUFFIX = random_prompt(128, seed=42), random_prompt(10, seed=43)


def test_a_prefix_hit_with_exact_replay_equals_a_cold_trimmed_run_bit_for_bit(checkpoint):
    options = {"decoder_trimming": True, "max_num_seqs": 1, "max_num_batched_tokens": 8, "num_kv_blocks": 4}
    cold = run(make_engine(*checkpoint, **options), [SHARED + SUFFIX], 4)[0]
    engine = make_engine(*checkpoint, enable_prefix_caching=True, swa_replay="exact", **options)
    run(engine, [SHARED + [9, 9]], 1)
    warm = run(engine, [SHARED + SUFFIX], 4)[0]
    assert warm.num_cached_tokens == 128
    assert_same_answers([warm], [cold], tolerance=0.0)
    bounded = make_engine(*checkpoint, enable_prefix_caching=True, **options)  # the V4.1 default replay
    run(bounded, [SHARED + [9, 9]], 1)
    hit = run(bounded, [SHARED + SUFFIX], 4)[0]
    assert hit.num_cached_tokens == 128 and len(hit.outputs[0].token_ids) == 4


# ------------------------------------------------------------------------------------------------ config


def resolve(checkpoint, **text_overrides):
    config = V41Config.from_dict(tiny_v41_config(**text_overrides))
    return EngineConfig(model=str(checkpoint[0]), decoder_trimming=True).resolve(config)


def test_a_plan_without_a_candidate_source_cannot_be_trimmed(checkpoint):
    with pytest.raises(ConfigError, match="decoder_trimming=True needs .* candidate source"):
        resolve(checkpoint, candidate_source_layer_id=-1)


@pytest.mark.parametrize("overrides, owned", [
    ({"kv_source_layer_ids": [2, 4, 5, 7]}, "layer 7 .* owns a compressor"),
    ({"engram_layer_ids": [1, 6]}, "layer 6 .* owns Engram"),
])
def test_later_layers_owning_per_row_state_cannot_be_trimmed(checkpoint, overrides, owned):
    with pytest.raises(ConfigError, match=f"decoder_trimming=True: {owned}"):
        resolve(checkpoint, **overrides)
    assert resolve(checkpoint).decoder_trimming is True
