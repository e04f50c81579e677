"""The engine against transformers' greedy reference: batching, chunking, preemption, abort, prefix cache."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import ConfigError, EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.testing.serving import record_attention_rows, serve
from tests.oracle import hf_greedy, hf_logprobs, hf_model, parity_config, random_state_dict, write_config

CONFIG = parity_config("hca128")  # window 16, CSA rate 4, HCA rate 128: one HCA entry per block
WEIGHTS = random_state_dict(CONFIG, seed=11)


@pytest.fixture(scope="module")
def oracle():
    return hf_model(CONFIG, WEIGHTS)


def make_engine(tmp_path, **options) -> Engine:
    write_config(tmp_path, CONFIG)
    return Engine(EngineConfig(model=str(tmp_path), dtype="float32", **options), weights=WEIGHTS)


def run(engine: Engine, prompts: list[list[int]], max_tokens: list[int], **params) -> dict[str, object]:
    outputs = serve(engine, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0, **params)
                                      for n in max_tokens])
    return {out.request_id: out for out in outputs}


def random_prompts(lengths, seed=0, vocab=CONFIG["vocab_size"]):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in lengths]


def assert_matches_oracle(oracle, prompt, output, tol=1e-4):
    tokens, logprobs = hf_greedy(oracle, prompt, len(output.token_ids))
    assert output.token_ids == tokens
    mine = [step[t].logprob for step, t in zip(output.logprobs, output.token_ids)]
    assert max(abs(a - b) for a, b in zip(mine, logprobs)) < tol


def test_many_requests_small_budget_and_pool_match_transformers(tmp_path, oracle):
    # prompts just under a block boundary decode across it, so a full pool must preempt
    lengths = [1, 3, 17, 118, 120, 122, 124, 126, 129, 200, 333, 520]
    max_tokens = [6, 9, 4, 14, 14, 12, 12, 10, 3, 6, 5, 3]
    prompts = random_prompts(lengths)
    engine = make_engine(tmp_path, max_num_seqs=6, max_num_batched_tokens=96, num_kv_blocks=7)
    done = run(engine, prompts, max_tokens)
    assert engine.stats()["num_preemptions"] > 0, "the pool was meant to force preemption"
    for i, prompt in enumerate(prompts):
        assert_matches_oracle(oracle, prompt, done[str(i)].outputs[0])
    assert engine.block_manager.num_free_blocks == 7


@pytest.mark.parametrize("budget", [125, 126, 127, 128, 129, 130, 131, 132])
def test_chunk_boundaries_at_every_offset(tmp_path, oracle, budget):
    # budgets 125..132 put chunk edges at every offset mod 4 and on both sides of 128 and 256
    prompt = random_prompts([300], seed=budget)[0]
    engine = make_engine(tmp_path, max_num_seqs=1, max_num_batched_tokens=budget, num_kv_blocks=4)
    assert_matches_oracle(oracle, prompt, run(engine, [prompt], [3])["0"].outputs[0])


@pytest.mark.parametrize("when", ["mid_prefill", "mid_decode"])
def test_abort_frees_everything(tmp_path, when):
    engine = make_engine(tmp_path, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=8)
    free_before = engine.block_manager.num_free_blocks
    engine.add_request("keep", random_prompts([40])[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request("drop", random_prompts([300], seed=1)[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    steps = 2 if when == "mid_prefill" else 7  # 300 tokens at 64 a step: prefill ends in step 5
    for _ in range(steps):
        engine.step()
    drop = next(s for s in engine.scheduler.running if s.request_id == "drop")
    assert drop.is_prefill == (when == "mid_prefill")
    engine.abort("drop")
    assert all(s.request_id != "drop" for s in engine.scheduler.running + list(engine.scheduler.waiting))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == free_before
    assert engine.stats()["num_running"] == engine.stats()["num_waiting"] == 0


def test_n_completions_and_seeded_sampling_are_reproducible(tmp_path):
    engine = make_engine(tmp_path, max_num_seqs=8, num_kv_blocks=8)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    [a] = serve(engine, [[5, 6, 7]], params, ["a"])
    first = [c.token_ids for c in a.outputs]
    assert len(first) == 3 and len({tuple(t) for t in first}) > 1, "each completion draws with its own seed"
    [b] = serve(engine, [[5, 6, 7]], params, ["b"])
    assert [c.token_ids for c in b.outputs] == first


# -- prefix cache -------------------------------------------------------------------------------------

SHARED = random_prompts([300], seed=42)[0]
SUFFIXES = random_prompts([20, 35, 50], seed=43)


def prefix_engine(tmp_path, replay: str) -> Engine:
    # 128-token chunks: the shared blocks are computed from identical chunks in every run, so the
    # cached entries can be compared bit for bit with a cold run's
    return make_engine(tmp_path, max_num_seqs=4, max_num_batched_tokens=128, num_kv_blocks=24,
                       enable_prefix_caching=True, swa_replay=replay)


def test_second_pass_hits_and_exact_replay_equals_cold(tmp_path, oracle):
    prompts = [SHARED + s for s in SUFFIXES]
    cold = run(make_engine(tmp_path, max_num_seqs=4, num_kv_blocks=24), prompts, [5, 5, 5])
    engine = prefix_engine(tmp_path, "exact")
    run(engine, [SHARED + [9, 9]], [1])  # warm the cache with the shared prefix
    warm = run(engine, prompts, [5, 5, 5])
    for i in range(3):
        assert warm[str(i)].num_cached_tokens >= 256
        assert warm[str(i)].outputs[0].token_ids == cold[str(i)].outputs[0].token_ids
    assert engine.stats()["prefix_cache_hit_tokens"] >= 3 * 256


def run_capturing_tables(engine: Engine, prompt: list[int], max_tokens: int):
    """Run one request; return its output and the block table it held."""
    tables, finish = [], engine.scheduler.finish

    def record_then_finish(seq, status):
        tables.append(list(seq.block_table))  # freed (and cleared) by finish
        finish(seq, status)

    engine.scheduler.finish = record_then_finish
    [out] = serve(engine, [prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0),
                  ["r"])
    engine.scheduler.finish = finish
    return out, tables[0]


def test_bounded_replay_keeps_cached_entries_and_reports_divergence(tmp_path):
    prompt = SHARED + SUFFIXES[0]
    cold, cold_table = run_capturing_tables(make_engine(tmp_path, max_num_seqs=2, num_kv_blocks=8), prompt, 8)
    cold_engine_entries = None

    engine = prefix_engine(tmp_path, "bounded")
    _, warm_table = run_capturing_tables(engine, SHARED + [9, 9], 1)
    hit_blocks = warm_table[:2]  # the two full 128-token blocks of the shared prefix
    before = _entries(engine, hit_blocks)
    warm, table = run_capturing_tables(engine, prompt, 8)
    assert warm.num_cached_tokens == 256 and table[:2] == hit_blocks
    for b, a in zip(before, _entries(engine, hit_blocks)):
        assert torch.equal(b, a), "replay must never overwrite cached compressed entries"

    reference = make_engine(tmp_path, max_num_seqs=2, max_num_batched_tokens=128, num_kv_blocks=8)
    _, ref_table = run_capturing_tables(reference, prompt, 1)
    cold_engine_entries = _entries(reference, ref_table[:2])
    for b, c in zip(before, cold_engine_entries):
        assert torch.equal(b, c), "cached entries must equal a cold run's entries for the same positions"

    mine, theirs = warm.outputs[0], cold.outputs[0]
    agree = sum(a == b for a, b in zip(mine.token_ids, theirs.token_ids)) / len(theirs.token_ids)
    first = abs(mine.logprobs[0][mine.token_ids[0]].logprob - theirs.logprobs[0][theirs.token_ids[0]].logprob)
    print(f"bounded replay vs cold: token agreement {agree:.2f}, first-token logprob divergence {first:.2e}")
    assert mine.token_ids[0] == theirs.token_ids[0] and first < 0.5, "bounded replay drifted far from cold"
    del cold_table


def _entries(engine: Engine, blocks: list[int]) -> list[torch.Tensor]:
    out = []
    for cache in engine.runner.kv_cache.layers:
        for pool in (cache.compressed, cache.index_keys):
            if pool is not None:
                per_block = (pool.shape[0] - 1) // (engine.runner.num_blocks + 2)  # + null and scratch blocks, + row
                rows = torch.cat([torch.arange(b * per_block, (b + 1) * per_block) for b in blocks])
                out.append(pool[rows].clone())
    return out


def test_prompt_logprobs_match_transformers_across_chunks(tmp_path, oracle):
    prompt = random_prompts([150], seed=9)[0]
    engine = make_engine(tmp_path, max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=4)
    done = run(engine, [prompt], [2], prompt_logprobs=3)
    got = done["0"].prompt_logprobs
    expected = hf_logprobs(oracle, prompt)
    assert got[0] is None and len(got) == len(prompt)
    for position in range(1, len(prompt)):
        entry, token = got[position], prompt[position]
        assert abs(entry[token].logprob - float(expected[position - 1, token])) < 1e-4
        assert entry[token].rank == int((expected[position - 1] > expected[position - 1, token]).sum()) + 1
        top = expected[position - 1].topk(3).indices.tolist()
        assert set(top) <= set(entry) and [entry[t].rank for t in top] == [1, 2, 3]


def test_stop_strings_cut_the_text_and_end_the_completion(tmp_path):
    engine = make_engine(tmp_path, max_num_seqs=2, num_kv_blocks=4)
    prompt = random_prompts([20], seed=3)[0]
    full = run(engine, [prompt], [24])["0"].outputs[0]
    assert engine.tokenizer is not None and len(full.text) > 12
    stop = full.text[8:12]
    first = full.text.find(stop)
    [out] = serve(engine, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                   stop=["\x00unseen", stop]), ["s"])
    cut = out.outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:first] and len(cut.token_ids) < len(full.token_ids)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def test_validate_prompt_rejects_ids_outside_the_vocabulary_and_non_integers(tmp_path):
    engine = make_engine(tmp_path, max_num_seqs=2, num_kv_blocks=4)
    vocab = CONFIG["vocab_size"]
    engine.validate_prompt([0, 5, vocab - 1])
    for prompt, shown in (([0, vocab], [vocab]), ([-1, 3], [-1]), ([3, 2.0], [2.0]), ([3, "7"], ["7"])):
        with pytest.raises(ValueError, match="outside the vocabulary") as err:
            engine.validate_prompt(prompt)
        assert str(shown) in str(err.value)


def test_exact_replay_recomputes_layers_times_window_and_equals_cold_bit_for_bit(tmp_path):
    # chunks of one window on both sides, and the replay starts on a chunk edge (256 - 3 x 16 = 208): the
    # steps that compute positions >= 208 have the same shapes in both runs, so any difference would be
    # the replay's, not a matmul's rounding under another chunking
    prompt, span = SHARED + SUFFIXES[0], CONFIG["num_hidden_layers"] * CONFIG["sliding_window"]
    options = {"max_num_seqs": 1, "max_num_batched_tokens": CONFIG["sliding_window"], "num_kv_blocks": 8}
    cold = run(make_engine(tmp_path, **options), [prompt], [6])["0"].outputs[0]
    engine = make_engine(tmp_path, enable_prefix_caching=True, **options)
    assert engine.config.swa_replay == "exact"  # V4's default
    run(engine, [SHARED + [9, 9]], [1])
    replayed = engine.stats()["prefix_cache_replay_tokens"]
    rows = record_attention_rows(engine)
    warm = run(engine, [prompt], [6])["0"]
    assert warm.num_cached_tokens == 256
    assert engine.stats()["prefix_cache_replay_tokens"] - replayed == span  # not the whole 256-token hit
    # layer l runs the replay from 256 - (3 - l) x 16 only: the rows its window keys and the next layer need
    window, layers = CONFIG["sliding_window"], CONFIG["num_hidden_layers"]
    assert [min(first) for first in rows] == [256 - (layers - layer) * window for layer in range(layers)]
    assert [len(prompt) + 5 - min(first) for first in rows] == [len(first) for first in rows]  # every row after it
    assert warm.outputs[0].token_ids == cold.token_ids
    assert [e[t].logprob for e, t in zip(warm.outputs[0].logprobs, cold.token_ids)] == \
        [e[t].logprob for e, t in zip(cold.logprobs, cold.token_ids)]


def test_exact_replay_under_batching_gives_the_cold_tokens(tmp_path):
    prompts = [SHARED + s for s in SUFFIXES]
    cold = run(make_engine(tmp_path, max_num_seqs=4, max_num_batched_tokens=128, num_kv_blocks=24), prompts, [6] * 3)
    engine = make_engine(tmp_path, max_num_seqs=4, max_num_batched_tokens=128, num_kv_blocks=24,
                         enable_prefix_caching=True)
    run(engine, [SHARED + [9, 9]], [1])
    rows = record_attention_rows(engine)
    warm = run(engine, prompts, [6] * 3)
    window = CONFIG["sliding_window"]  # each request's replay: one window fewer a layer up
    assert [len(rows[0]) - len(seen) for seen in rows] == [3 * layer * window for layer in range(len(rows))]
    for i in range(3):
        mine, theirs = warm[str(i)].outputs[0], cold[str(i)].outputs[0]
        assert warm[str(i)].num_cached_tokens == 256 and mine.token_ids == theirs.token_ids
        for step, theirs_step, token in zip(mine.logprobs, theirs.logprobs, mine.token_ids):
            assert abs(step[token].logprob - theirs_step[token].logprob) < 1e-5  # chunk shapes differ


def test_bounded_replay_is_the_opt_in_approximation(tmp_path):
    engine = prefix_engine(tmp_path, "bounded")
    run(engine, [SHARED + [9, 9]], [1])
    before = engine.stats()["prefix_cache_replay_tokens"]
    run(engine, [SHARED + SUFFIXES[0]], [2])
    assert engine.stats()["prefix_cache_replay_tokens"] - before == CONFIG["sliding_window"]


def test_engram_prefetch_changes_nothing_for_a_model_without_engram(tmp_path):
    prompts = random_prompts([9, 20], seed=5)
    outputs = []
    for options in ({}, {"engram_prefetch": False}):
        engine = make_engine(tmp_path, **options)
        done = run(engine, prompts, [3, 3])
        outputs.append([(done[k].outputs[0].token_ids, done[k].outputs[0].logprobs) for k in sorted(done)])
        engine.shutdown()  # a model without `close` shuts down as before
    assert outputs[0] == outputs[1]
    with pytest.raises(ConfigError, match="engram_placement='host'"):
        make_engine(tmp_path, engram_placement="host")


def test_token_times_are_stamped_after_the_tokens_are_read(tmp_path):
    """A step's token times (and so TTFT) come from when its sampled tokens reached the host, not from
    before the device read: a read that takes 50 ms is inside the first token's time."""
    engine = make_engine(tmp_path, max_num_seqs=2, num_kv_blocks=8)
    reads = []

    class SlowRead:  # the sampled tokens' device read, slowed down
        def __init__(self, tensor):
            self.tensor = tensor

        def tolist(self):
            time.sleep(0.05)
            reads.append(time.time())
            return self.tensor.tolist()

    sample = engine.executor.sample

    def slow_sample(grammar_rows=None, **kwargs):
        result = sample(grammar_rows, **kwargs)
        if result.output is not None:
            result.output = dataclasses.replace(result.output, token_ids=SlowRead(result.output.token_ids))
        return result

    engine.executor.sample = slow_sample
    engine.add_request("a", random_prompts([20])[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    [out] = engine.step()
    assert len(out.outputs[0].token_ids) == 1 and len(reads) == 1
    assert out.metrics.first_token_time >= reads[0]
