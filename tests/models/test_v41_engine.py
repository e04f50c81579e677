"""DeepSeek-V4.1 through the engine: generate and chat from the official layout, batching with chunked
prefill and preemption, prefix hits (exact replay bit for bit, bounded replay by default)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.entrypoints.chat import chat_encoding_of
from tests.models.v41_helpers import make_engine, make_runner, random_prompt, run, tiny_checkpoint
from tests.oracle import run_chunked


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def chosen_logprobs(output):
    completion = output.outputs[0]
    return [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]


def test_generate_and_chat_load_the_official_layout_and_follow_the_forward(checkpoint):
    directory, weights = checkpoint
    llm = LLM(model=str(directory), dtype="float32", max_num_seqs=2, num_kv_blocks=8)
    prompt = random_prompt(20, seed=1)
    tokens = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    # every greedy token is the argmax of a full forward over what came before it
    forward = run_chunked(make_runner(directory, weights), [prompt + tokens[:-1]], chunk=1000)[0]
    assert forward[len(prompt) - 1 :].argmax(-1).tolist() == tokens
    encoding = chat_encoding_of(llm)
    assert encoding.model_names[0] == "DeepSeek-V4.1-Flash"
    answer = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                      SamplingParams(temperature=0, max_tokens=3))[0]
    assert answer.usage["completion_tokens"] == 3 and answer.usage["prompt_tokens"] > 5


def test_batching_chunked_prefill_and_preemption_change_nothing(checkpoint):
    lengths, max_tokens = (118, 120, 122, 124, 126), [14, 12, 12, 10, 8]  # all decode across the block edge
    prompts = [random_prompt(n, seed=n) for n in lengths]
    alone = [run(make_engine(*checkpoint, max_num_seqs=1), [p], [n])[0] for p, n in zip(prompts, max_tokens)]
    engine = make_engine(*checkpoint, max_num_seqs=5, max_num_batched_tokens=93, num_kv_blocks=6)
    together = run(engine, prompts, max_tokens)
    assert engine.stats()["num_preemptions"] > 0, "the pool was meant to force preemption"
    for mine, theirs in zip(together, alone):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert max(abs(a - b) for a, b in zip(chosen_logprobs(mine), chosen_logprobs(theirs))) < 1e-4


SHARED = random_prompt(128, seed=42)
SUFFIX = random_prompt(10, seed=43)


def test_a_prefix_hit_with_exact_replay_equals_a_cold_run_bit_for_bit(checkpoint):
    # chunks of one window on both sides; the replay starts at 128 - 9 layers x 8 = 56, a chunk edge
    options = {"max_num_seqs": 1, "max_num_batched_tokens": 8, "num_kv_blocks": 4}
    cold = run(make_engine(*checkpoint, **options), [SHARED + SUFFIX], [4])[0]
    engine = make_engine(*checkpoint, enable_prefix_caching=True, swa_replay="exact", **options)
    run(engine, [SHARED + [9, 9]], [1])
    replayed = engine.stats()["prefix_cache_replay_tokens"]
    warm = run(engine, [SHARED + SUFFIX], [4])[0]
    assert warm.num_cached_tokens == 128
    assert engine.stats()["prefix_cache_replay_tokens"] - replayed == 9 * 8
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert chosen_logprobs(warm) == chosen_logprobs(cold)


def test_a_prefix_block_back_from_host_memory_carries_its_token_ids(checkpoint):
    """V4.1 keeps each position's token id in the paged cache (Engram reads them); a block evicted to the
    host tier and loaded back brings them along: the hit equals a cold run bit for bit (exact replay)."""
    options = {"max_num_seqs": 1, "max_num_batched_tokens": 8, "num_kv_blocks": 3}
    cold = run(make_engine(*checkpoint, **options), [SHARED + SUFFIX], [4])[0]
    engine = make_engine(*checkpoint, enable_prefix_caching=True, swa_replay="exact", host_cache_gib=0.01, **options)
    run(engine, [SHARED + [9, 9]], [1])
    run(engine, [random_prompt(300, seed=7)], [1])  # three blocks through a three-block pool: SHARED's leaves
    warm = run(engine, [SHARED + SUFFIX], [4])[0]
    assert engine.stats()["prefix_cache_hit_tokens_host"] == 128 and warm.num_cached_tokens == 128
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert chosen_logprobs(warm) == chosen_logprobs(cold)


def test_a_blocks_bytes_carry_its_token_ids(checkpoint):
    """What the host tier, the store and prefill/decode transfers move of a block includes V4.1's token
    ids (a decode instance that loads a prompt's blocks with no replay looks back into them)."""
    from deepinfer_core.kv.blocks import BlockIO

    engine = make_engine(*checkpoint, enable_prefix_caching=True, max_num_seqs=1)
    run(engine, [SHARED + [9, 9]], [1])
    runner = engine.executor.runner
    assert [s.name for s in runner.block_layout].count("token_ids") == 1
    pool = next(c.token_ids for c in runner.kv_cache.layers if c.token_ids is not None).view(-1, 128)
    used, free = (pool != 0).any(dim=1).nonzero().flatten(), (pool == 0).all(dim=1).nonzero().flatten()
    source, target = int(used[0]), int(free[-1])
    io = BlockIO(runner.block_layout, runner.kv_cache.layers)
    io.scatter((target,), io.gather((source,)).wait())
    assert torch.equal(pool[target], pool[source])


def test_bounded_replay_is_the_default_and_never_rewrites_cached_entries(checkpoint):
    engine = make_engine(*checkpoint, max_num_seqs=1, max_num_batched_tokens=64, num_kv_blocks=4,
                         enable_prefix_caching=True)
    assert engine.config.swa_replay == "bounded"  # V4.1 was trained for SWA Bounded Replay
    run(engine, [SHARED + [9, 9]], [1])
    caches = engine.runner.kv_cache.layers
    pools = [(c.compressed, c.index_keys, c.token_ids) for c in caches]
    before = [t.clone() for group in pools for t in group if t is not None]
    replayed = engine.stats()["prefix_cache_replay_tokens"]
    warm = run(engine, [SHARED + SUFFIX], [3])[0]
    assert warm.num_cached_tokens == 128 and engine.stats()["prefix_cache_replay_tokens"] - replayed == 8
    after = [t for group in pools for t in group if t is not None]
    for b, a in zip(before, after):  # the hit block is block 1, the first one handed out (0: the null block)
        per_block = b.shape[0] // (engine.runner.num_blocks + 2)
        assert torch.equal(b[per_block : 2 * per_block], a[per_block : 2 * per_block]), \
            "replay must never overwrite the cached block"


def test_engram_hashes_are_the_same_whole_chunked_and_after_a_prefix_hit(checkpoint, monkeypatch):
    from deepinfer_core.models.deepseek_v41.engram import EngramHasher

    seen: list[dict[int, torch.Tensor]] = []
    real = EngramHasher.hashes

    def record(self, lookback):
        out = real(self, lookback)
        seen[-1]["rows"].append(out)
        return out

    monkeypatch.setattr(EngramHasher, "hashes", record)
    prompt = SHARED + SUFFIX

    def hashes_of(engine, prompts, warm=None):
        if warm:
            run(engine, [warm], [1])
        seen.append({"rows": []})
        run(engine, prompts, [1])
        return torch.cat(seen[-1]["rows"])  # one request: its rows in position order

    whole = hashes_of(make_engine(*checkpoint, max_num_seqs=1), [prompt])
    chunked = hashes_of(make_engine(*checkpoint, max_num_seqs=1, max_num_batched_tokens=7), [prompt])
    assert torch.equal(whole, chunked)
    warm = make_engine(*checkpoint, max_num_seqs=1, enable_prefix_caching=True)
    hit = hashes_of(warm, [prompt], warm=SHARED + [9, 9])
    assert warm.stats()["prefix_cache_hit_tokens"] >= 128 and len(hit) == 8 + len(SUFFIX)  # bounded replay
    assert torch.equal(hit, whole[-len(hit):])  # the replayed and new positions, from the cached ids


def first_token_logprobs(engine, prompt) -> torch.Tensor:
    """The full fp32 distribution the engine samples the first generated token from."""
    model, rows = engine.runner.model, []
    real = model.forward

    def record(*args, **kwargs):
        logits = real(*args, **kwargs)
        if len(logits):  # steps of a non-final prefill chunk sample nothing
            rows.append(logits[-1].clone())
        return logits

    model.forward = record
    run(engine, [prompt], [1])
    model.forward = real
    return rows[-1].log_softmax(-1)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    return float((p_log.exp() * (p_log - q_log)).sum())


def test_bounded_replay_against_a_cold_run_kl_and_top_1(checkpoint):
    """research-v41.md §11.8: a hit with exact replay is the cold run (KL 0, same top 1); with bounded
    replay (8 of the 9 x 8 rows exact replay recomputes) the first token's distribution moves, by far
    less than changing the prompt's last token moves it. The tiny random model's distributions are
    nearly flat (entropy ~11.45 of 11.77 nats), so its top 1 may change under any perturbation: only
    the exact hit's is asserted."""
    options = {"max_num_seqs": 1, "max_num_batched_tokens": 8, "num_kv_blocks": 4}
    prompt = SHARED + SUFFIX
    cold = first_token_logprobs(make_engine(*checkpoint, **options), prompt)
    other = first_token_logprobs(make_engine(*checkpoint, **options), prompt[:-1] + [prompt[-1] + 1])
    warm = {}
    for mode in ("exact", "bounded"):
        engine = make_engine(*checkpoint, enable_prefix_caching=True, swa_replay=mode, **options)
        run(engine, [SHARED + [9, 9]], [1])
        warm[mode] = first_token_logprobs(engine, prompt)
        assert engine.stats()["prefix_cache_hit_tokens"] == 128
    assert kl(cold, warm["exact"]) == 0 and warm["exact"].argmax() == cold.argmax()
    scale = kl(cold, other)
    assert scale > 0.1  # a different last token: a different distribution
    assert 0 < kl(cold, warm["bounded"]) < 0.01 * scale  # approximate, and close (7.6e-4 against 0.41)
