"""Expert and data parallelism end to end: worker ranks over gloo give the single-process engine's tokens.

The tiny model has a hash-routed layer and two top-k layers. Requests mix greedy and seeded sampling,
prompts long enough for chunked prefill, a pool small enough to preempt, and a second pass that hits
the prefix cache. Data-parallel ranks batch their own requests, so their matmuls see other batches
than the single engine's: logprobs agree to 1e-5, as between any two batch compositions (see
test_engine.py's exact-replay-under-batching test); a world of one EP rank batches exactly as the
single engine does and matches it bit for bit.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.data_parallel import DataParallelEngine, build_engine
from deepinfer_core.executor.protocol import WorkerError
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config
from deepinfer_core.testing.serving import serve
from tests.engine import test_tp_engine as tp_engine
from tests.engine.test_spec_decode import CONFIG as MTP_CONFIG
from tests.engine.test_spec_decode import generate as spec_generate
from tests.engine.test_spec_decode import tokens as completion_tokens
from tests.engine.test_spec_mtp import WEIGHTS as MTP_WEIGHTS
from tests.oracle import write_config

CONFIG = tiny_config("sliding_csa_hca", index_n_heads=16)
WEIGHTS = random_state_dict(CONFIG, seed=5)
LENGTHS, MAX_TOKENS = [3, 118, 124, 126, 260, 33], [4, 12, 8, 6, 3, 4]
EPLB = {"enable_eplb": True, "eplb_config": {"num_redundant_experts": 2, "window_size": 4, "step_interval": 3}}


def make_engine(directory, **options):
    write_config(directory, CONFIG)
    options = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_kv_blocks": 4, "enable_prefix_caching": True,
               "worker_timeout_s": 60, **options}
    return build_engine(EngineConfig(model=str(directory), dtype="float32", **options), weights=WEIGHTS)


def prompts():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(2, CONFIG["vocab_size"], (n,), generator=generator).tolist() for n in LENGTHS]


def run(engine, requests) -> dict[str, tuple[list[int], list[float]]]:
    request_ids, prompts, params = zip(*requests, strict=True)
    done = {}
    for out in serve(engine, prompts, params, request_ids):
        c = out.outputs[0]
        done[out.request_id] = (c.token_ids, [e[t].logprob for e, t in zip(c.logprobs, c.token_ids)])
    return done


def generate(engine) -> tuple[dict, dict]:
    """Two passes: a batch, then a request repeating a first-pass prompt (a prefix-cache hit)."""
    batch = [(str(i), p, SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=n, ignore_eos=True,
                                        logprobs=0)) for i, (p, n) in enumerate(zip(prompts(), MAX_TOKENS))]
    done = run(engine, batch)
    done.update(run(engine, [("again", prompts()[4] + [7, 8, 9], SamplingParams(temperature=0, max_tokens=4,
                                                                               ignore_eos=True, logprobs=0))]))
    return done, engine.stats()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    engine = make_engine(tmp_path_factory.mktemp("single"))
    done, stats = generate(engine)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    model = engine.runner.model
    return done, sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for request_id, (tokens, logprobs) in expected.items():
        assert got[request_id][0] == tokens, request_id
        assert max(abs(a - b) for a, b in zip(got[request_id][1], logprobs)) < 1e-5, request_id


def test_one_ep_rank_with_eplb_matches_the_single_engine_bit_for_bit(tmp_path, single):
    single, _ = single
    engine = make_engine(tmp_path, enable_expert_parallel=True, **EPLB)
    try:
        done, stats = generate(engine)
    finally:
        engine.shutdown()
    assert done == single
    eplb = stats["eplb"]
    assert eplb["num_rebalances"] >= 2 and eplb["pause_s"] > 0  # rebalanced mid-generation, outputs unchanged
    assert 1.0 <= eplb["balance_after"] <= eplb["balance_before"] + 1e-9


def test_two_dp_ranks_with_experts_over_both_match_the_single_engine_through_rebalances(tmp_path, single):
    engine = make_engine(tmp_path, data_parallel_size=2, enable_expert_parallel=True, num_kv_blocks=3, **EPLB)
    try:
        assert isinstance(engine, DataParallelEngine)
        done, stats = generate(engine)
    finally:
        engine.shutdown()
    assert_same(done, single[0])
    ranks = stats["data_parallel"]
    assert all(r["num_prefill_tokens"] > 0 for r in ranks), "the front-end kept one rank idle"
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["num_preemptions"] > 0
    memory = stats["rank_memory"]
    assert [m["rank"] for m in memory] == [0, 1] and all(m["cache_bytes"] > 0 for m in memory)
    assert stats["eplb"]["num_rebalances"] >= 2  # experts moved between the ranks mid-generation


def test_four_dp_ranks_hold_a_quarter_of_the_experts_each(tmp_path, single):
    whole = sum(t.numel() * t.element_size() for name, t in WEIGHTS.items() if ".experts." in name)
    engine = make_engine(tmp_path, data_parallel_size=4, enable_expert_parallel=True, num_kv_blocks=6)
    try:
        done, stats = generate(engine)
    finally:
        engine.shutdown()
    expected, full = single
    assert_same(done, expected)
    for m in stats["rank_memory"]:  # each rank: everything but three quarters of the routed experts
        assert m["weights_bytes"] == full - whole * 3 // 4


def test_experts_the_ranks_do_not_divide_split_unevenly_and_match_the_single_engine(tmp_path):
    """9 experts over 2 EP ranks (vLLM's split: 5 and 4): each rank loads its share and the tokens equal
    one rank's."""
    config = tiny_config("sliding_csa_hca", index_n_heads=16, n_routed_experts=9)
    weights = random_state_dict(config, seed=7)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    batch = [(str(i), p[:50], params) for i, p in enumerate(prompts()[:4])]
    options = {"dtype": "float32", "max_num_seqs": 4, "num_kv_blocks": 6, "worker_timeout_s": 60}
    write_config(tmp_path, config)
    want = run(build_engine(EngineConfig(model=str(tmp_path), **options), weights=weights), batch)
    engine = build_engine(EngineConfig(model=str(tmp_path), data_parallel_size=2, enable_expert_parallel=True,
                                       **options), weights=weights)
    try:
        got, memory = run(engine, batch), engine.stats()["rank_memory"]
    finally:
        engine.shutdown()
    assert_same(got, want)
    experts = sum(t.numel() * t.element_size() for name, t in weights.items() if ".experts." in name)
    assert memory[0]["weights_bytes"] - memory[1]["weights_bytes"] == experts // 9  # rank 0 holds one expert more


def test_a_killed_rank_ends_the_engine_naming_it(tmp_path):
    engine = make_engine(tmp_path, data_parallel_size=2, enable_expert_parallel=True, worker_timeout_s=20)
    engine.add_request("a", prompts()[2], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    os.kill(engine.cores.procs[1].pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"worker rank 1 (exited|.*pipe is closed).*-9"):
        while engine.has_unfinished_requests():
            engine.step()
    assert all(proc.poll() is not None for proc in engine.cores.procs)  # rank 0 did not hang in a collective


TORCHRUN_SCRIPT = """
import json, sys
from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.data_parallel import build_engine

engine = build_engine(EngineConfig(model=sys.argv[1], dtype="float32", max_num_seqs=2, num_kv_blocks=4,
                                   data_parallel_size=2, **json.loads(sys.argv[3])))
# only rank 0 gets here: the other ranks serve inside build_engine(...) and exit when rank 0 shuts down
for i, prompt in enumerate(json.loads(sys.argv[2])):
    engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
done = {}
while engine.has_unfinished_requests():
    done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
print("TOKENS " + json.dumps(done), flush=True)
engine.shutdown()
"""


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory):
    """The checkpoint, launch script, batch and single-process tokens both torchrun layouts are checked
    against: written and run once for the module (the ranks only read them)."""
    from deepinfer_core.testing.checkpoints import write_checkpoint

    directory = tmp_path_factory.mktemp("torchrun")
    model_dir = write_checkpoint(directory / "model", CONFIG, WEIGHTS)
    script = directory / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    batch = [p[:40] for p in prompts()[1:4]]
    expected = build_engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=2, num_kv_blocks=4))
    want = run(expected, [(str(i), p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))
                          for i, p in enumerate(batch)])
    return model_dir, script, batch, want


@pytest.mark.parametrize("layout", [{"enable_expert_parallel": True}, {"tensor_parallel_size": 2}],
                         ids=["dp2-ep", "dp2-tp2"])
def test_torchrun_ranks_run_data_and_expert_parallelism(torchrun_reference, layout):
    """DP 2 with expert parallelism (2 ranks), and DP 2 of two tensor-parallel ranks each (4 ranks: each
    DP rank's first rank hosts its core and drives the second), under torchrun."""
    import json
    import subprocess
    import sys

    model_dir, script, batch, want = torchrun_reference
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(2 * layout.get("tensor_parallel_size", 1)), str(script), str(model_dir), json.dumps(batch),
         json.dumps(layout)],
        check=False, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, proc.stdout
    assert json.loads(lines[0].removeprefix("TOKENS ")) == {i: tokens for i, (tokens, _) in want.items()}


def test_the_mtp_drafter_with_data_and_expert_parallelism(tmp_path):
    """Each DP rank's MTP layer drafts for its own requests, its routed experts held whole (not split by
    expert parallelism): greedy output equals decoding without speculation, and the engine's counters
    are the ranks' sums, the single process's."""
    want, _, want_stats = tp_engine.single_process_mtp(3)
    write_config(tmp_path, MTP_CONFIG)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "draft_length_policy": "fixed"}
    engine = build_engine(EngineConfig(model=str(tmp_path), dtype="float32", speculative_config=spec, max_num_seqs=4,
                                       num_kv_blocks=24, data_parallel_size=2, enable_expert_parallel=True,
                                       worker_timeout_s=60), weights=MTP_WEIGHTS)
    try:
        assert isinstance(engine, DataParallelEngine)
        got = completion_tokens(spec_generate(engine, tp_engine.PROMPTS, tp_engine.MAX_TOKENS, temperature=0))
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert got == want == tp_engine.single_process_mtp(None)[0]
    assert [rank["spec_verify_steps"] > 0 for rank in stats["data_parallel"]] == [True, True]  # both ranks drafted
    assert {c: stats[c] for c in tp_engine.SPEC_COUNTERS} == {c: want_stats[c] for c in tp_engine.SPEC_COUNTERS}
