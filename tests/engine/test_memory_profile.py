"""The start-up memory profile (`worker.memory_profile`): the KV cache is sized beside the largest step's
measured peak, a configuration without room for one max-length request fails at start-up with the
numbers, the profile leaves no state behind, and a device without counters (the CPU) keeps the estimate.

The device is the CPU throughout; a fake platform plugin offers counters whose peak reads what the test
sets, so the profile's forward and sampling run for real and only the numbers are chosen.
"""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer_core.backends import MemoryCounters
from deepinfer_core.config import EngineConfig, ModelConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.kv.cache import bytes_per_block, bytes_per_slot
from deepinfer_core.models.layer_plan import BLOCK_SIZE, build_layer_plan
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.testing.serving import serve
from deepinfer_core.worker import model_loader
from deepinfer_core.worker.memory_profile import worst_step
from deepinfer_core.worker.runner import ModelRunner
from tests.oracle import parity_config, random_state_dict, write_config

CONFIG = parity_config("hca128")
WEIGHTS = random_state_dict(CONFIG, seed=5)
MODEL = ModelConfig.from_dict(CONFIG)
PLANS = build_layer_plan(MODEL, torch.float32)
PER_BLOCK = bytes_per_block(PLANS, torch.float32)
SLOTS, MAX_LEN = 4, 512
CPU = torch.device("cpu")


class FakePlatform:
    """A platform plugin whose device has `free` bytes free and whose peak reads `peak` bytes above what
    is live; counts the profile's steps (`resets`)."""

    def __init__(self, free: int, peak: int) -> None:
        self.free, self.peak, self.resets = free, peak, 0

    def _reset(self) -> None:
        self.resets += 1

    @hookimpl
    def memory_counters(self, device, decline):
        return MemoryCounters(mem_get_info=lambda: (self.free, 2 * self.free), allocated=lambda: 0,
                              reserved=lambda: 0, peak_allocated=lambda: self.peak, reset_peak=self._reset,
                              synchronize=lambda: None, empty_cache=lambda: None)


def engine_config(tmp_path, **options) -> EngineConfig:
    write_config(tmp_path, CONFIG)
    options = {"max_num_seqs": SLOTS, "max_model_len": MAX_LEN, "max_num_batched_tokens": 64, **options}
    return EngineConfig(model=str(tmp_path), dtype="float32", gpu_memory_utilization=0.5, **options)


def runner(tmp_path, **options) -> ModelRunner:
    return ModelRunner(MODEL, engine_config(tmp_path, **options).resolve(MODEL), CPU, weights=WEIGHTS)


# free memory whose half holds the request slots and exactly 40 blocks
FREE = 2 * (SLOTS * bytes_per_slot(PLANS, torch.float32) + 40 * PER_BLOCK)


def test_the_cache_loses_exactly_the_measured_peak_in_blocks(tmp_path, isolated_plugin_manager):
    platform = FakePlatform(FREE, peak=0)
    isolated_plugin_manager.register(platform, name="fake")
    assert runner(tmp_path).num_blocks == 40
    platform.peak = 7 * PER_BLOCK
    measured = runner(tmp_path)
    assert measured.num_blocks == 40 - 7
    assert measured.memory_profile.peak_transient == 7 * PER_BLOCK and platform.resets == 2  # one step each
    platform.peak = 7 * PER_BLOCK + 1  # a byte more costs a whole block
    assert runner(tmp_path).num_blocks == 40 - 8


def test_no_room_for_one_max_length_request_fails_at_start_up_with_the_numbers(tmp_path, isolated_plugin_manager):
    needed = MAX_LEN // BLOCK_SIZE
    isolated_plugin_manager.register(FakePlatform(FREE, peak=(40 - needed + 1) * PER_BLOCK), name="fake")
    with pytest.raises(MemoryError) as info:
        Engine(engine_config(tmp_path), weights=WEIGHTS)
    message = str(info.value)
    assert message.startswith(f"the KV cache has no room for one {MAX_LEN}-token request: gpu_memory_utilization 0.5")
    assert f"leaves {needed - 1} blocks" in message and f"one request needs {needed}" in message
    assert "largest step (64 tokens over 4 sequences, measured" in message
    for fix in ("Lower max_num_batched_tokens", "now 64", "max_num_seqs", "raise gpu_memory_utilization"):
        assert fix in message


def test_configured_blocks_that_do_not_fit_beside_the_step_fail_at_start_up(tmp_path, isolated_plugin_manager):
    isolated_plugin_manager.register(FakePlatform(FREE, peak=FREE), name="fake")
    with pytest.raises(MemoryError, match=r"num_kv_blocks=8 does not fit: .* Lower num_kv_blocks"):
        runner(tmp_path, num_kv_blocks=8)


def test_the_worst_step_spends_the_whole_budget_and_reads_a_full_context():
    plan, num_blocks = worst_step(num_tokens=300, num_seqs=4, max_model_len=MAX_LEN)
    assert plan.num_tokens == 300 and [r.num_tokens for r in plan.requests] == [297, 1, 1, 1]
    assert plan.requests[0].end == MAX_LEN and all(r.is_sampled for r in plan.requests)
    assert num_blocks == MAX_LEN // BLOCK_SIZE + 3
    plan, _ = worst_step(num_tokens=2000, num_seqs=8, max_model_len=MAX_LEN)  # no sequence past max_model_len
    assert plan.num_tokens == 2000 and max(r.num_tokens for r in plan.requests) == MAX_LEN


def serve_both(engine: Engine) -> list[list[int]]:
    prompts = [list(range(3, 3 + n)) for n in (30, 5)]
    greedy = serve(engine, prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    sampled = serve(engine, prompts, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=2, ignore_eos=True))
    return [out.outputs[0].token_ids for out in [*greedy, *sampled]]


def test_the_profile_leaves_no_state_behind(tmp_path, isolated_plugin_manager):
    """Deterministic mode: the same engine with and without the profile's step gives the same first
    outputs, holds no request, no used block, no cached prefix and an untouched cache, and the global RNG
    is where it would be."""
    def build(tmp, platform=None):
        if platform is not None:
            isolated_plugin_manager.register(platform, name="fake")
        tmp.mkdir()
        torch.manual_seed(0)
        engine = Engine(engine_config(tmp, num_kv_blocks=32, deterministic=True, enable_prefix_caching=True),
                        weights=WEIGHTS)
        return engine, torch.get_rng_state()

    plain, plain_rng = build(tmp_path / "plain")
    platform = FakePlatform(FREE, peak=PER_BLOCK)
    profiled, profiled_rng = build(tmp_path / "profiled", platform)
    runner_ = profiled.executor.runner
    assert platform.resets == 1 and runner_.memory_profile.measured
    assert torch.equal(plain_rng, profiled_rng)
    assert runner_.requests == {} and profiled.stats()["num_free_blocks"] == profiled.stats()["num_blocks"]
    assert all(not t.any() for layer in runner_.kv_cache.layers for t in vars(layer).values()
               if isinstance(t, torch.Tensor))
    assert serve_both(profiled) == serve_both(plain)
    assert profiled.stats()["rank_memory"][0]["step_peak_bytes"] == PER_BLOCK
    assert plain.stats()["rank_memory"][0]["step_peak_bytes"] is None


def test_the_profile_runs_with_the_drafter_attached(tmp_path, isolated_plugin_manager):
    """The MTP drafter is built before the profile: its weights are loaded when free memory is read, and
    the measured step keeps the final streams the drafter reads (dropped again after it)."""
    seen = []

    class Watching(FakePlatform):
        def _reset(self) -> None:
            seen.append((built.model.keeps_final_streams, built.mtp is not None))

    isolated_plugin_manager.register(Watching(FREE, peak=0), name="fake")
    write_config(tmp_path, CONFIG)
    cfg = engine_config(tmp_path, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    built = ModelRunner.__new__(ModelRunner)  # the hook reads the runner while its __init__ runs
    ModelRunner.__init__(built, MODEL, cfg.resolve(MODEL), CPU, weights=random_state_dict(CONFIG, seed=5, mtp_layers=1))
    assert seen == [(True, True)] and built.model.final_streams is None


def test_the_cpu_is_not_measured_and_sized_as_before(tmp_path, isolated_plugin_manager, caplog):
    with caplog.at_level(logging.INFO, logger="deepinfer_core.worker.model_loader"):
        built = runner(tmp_path)
    assert not built.memory_profile.measured
    assert "peak not measured (no plugin offers memory counters for cpu)" in caplog.text
    cfg = engine_config(tmp_path).resolve(MODEL)
    assert built.num_blocks == model_loader.available_blocks(PLANS, torch.float32, CPU, cfg)
