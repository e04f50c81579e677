"""Engram tables in host memory (`engram_placement="host"`), with the prefetch worker
(`models/engram_prefetch.py`) and without it: the same tokens and logprobs as tables on the device, bit
for bit; the rows come from the worker thread, which shutdown stops; a failed gather is an error naming
its layer, never a hang; bad values name the field. Layer ops that read host rows from the device
(`HostRowGather`) serve the tables with no host step: no worker, and decode stays graph-safe."""

from __future__ import annotations

import threading

import pytest
import torch
from pydantic import ValidationError

from deepinfer_core import SamplingParams
from deepinfer_core.models.deepseek_v41.engram import EngramTable
from deepinfer_core.models.deepseek_v41.engram_prefetch import (
    THREAD_NAME,
    EngramGatherError,
    EngramPrefetcher,
)
from tests.models.v41_helpers import make_engine, random_prompt, tiny_checkpoint
from tests.oracle import greedy_tokens_and_logprobs

PROMPTS = [random_prompt(30, seed=1), random_prompt(11, seed=2)]
# two prompts, a 16-token budget: chunked prefill, then decode steps of both
OPTIONS = {"max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 6}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def on_device(checkpoint):
    engine = make_engine(*checkpoint, **OPTIONS)
    assert {t.placement for t in engine.runner.model.tables.values()} == {"device"}
    return greedy_tokens_and_logprobs(engine, PROMPTS, 4)


class Recorder:
    """Wraps `EngramPrefetcher.gather` and `EngramTable.lookup`: which threads gathered, how many lookups."""

    def __init__(self, monkeypatch) -> None:
        self.threads, self.num_lookups = [], 0
        gather, lookup = EngramPrefetcher.gather, EngramTable.lookup

        def recorded_gather(prefetcher, *args):
            self.threads.append(threading.current_thread())
            return gather(prefetcher, *args)

        def counted_lookup(table, hash_ids):
            self.num_lookups += 1
            return lookup(table, hash_ids)

        monkeypatch.setattr(EngramPrefetcher, "gather", recorded_gather)
        monkeypatch.setattr(EngramTable, "lookup", counted_lookup)


def test_prefetched_host_rows_equal_device_rows_and_shutdown_stops_the_worker(checkpoint, on_device, monkeypatch):
    recorder = Recorder(monkeypatch)
    engine = make_engine(*checkpoint, engram_placement="host", **OPTIONS)
    model = engine.runner.model
    assert {t.placement for t in model.tables.values()} == {"host"} and model.prefetcher is not None
    assert greedy_tokens_and_logprobs(engine, PROMPTS, 4) == on_device
    # every Engram layer's rows of every step came from the worker, none from a lookup at the layer
    assert recorder.num_lookups == 0 and len(recorder.threads) >= 2 * len(model.tables)
    assert len(recorder.threads) % len(model.tables) == 0
    worker = recorder.threads[0]
    assert worker is not threading.main_thread() and worker.name.startswith(THREAD_NAME)
    assert all(t is worker for t in recorder.threads) and worker.is_alive()
    engine.shutdown()
    assert not worker.is_alive() and model.prefetcher is None


def test_synchronous_host_lookups_equal_device_rows(checkpoint, on_device, monkeypatch):
    recorder = Recorder(monkeypatch)
    engine = make_engine(*checkpoint, engram_placement="host", engram_prefetch=False, **OPTIONS)
    assert engine.runner.model.prefetcher is None
    assert greedy_tokens_and_logprobs(engine, PROMPTS, 4) == on_device
    assert recorder.threads == [] and recorder.num_lookups > 0  # gathered at the layer, on this thread
    engine.shutdown()


def test_a_failed_gather_names_its_layer_and_the_worker_serves_on(checkpoint):
    engine = make_engine(*checkpoint, engram_placement="host", **OPTIONS)
    model, prefetcher = engine.runner.model, engine.runner.model.prefetcher
    table = model.tables[4]
    whole, table.weight = table.weight, table.weight[:1]  # every id past row 0 is out of range
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    with pytest.raises(EngramGatherError, match=r"gather of layer 4 failed: \w+Error: .*index"):
        engine.step()
    table.weight = whole
    num_rows = min(t.weight.shape[0] for t in model.tables.values())
    ids = torch.randint(0, num_rows, (3, len(model.tables), model.hasher.primes.shape[1]))
    pending = prefetcher.start(ids)
    assert torch.equal(pending.rows(4), table.lookup(ids[:, 1]))
    pending.drain()  # layer 1's rows, never asked for
    engine.shutdown()
    with pytest.raises(EngramGatherError, match="closed"):
        prefetcher.start(ids)


@pytest.mark.parametrize("field, value", [("engram_placement", "disk"), ("engram_prefetch", "sometimes")])
def test_bad_values_name_the_field(checkpoint, field, value):
    with pytest.raises(ValidationError, match=field):
        make_engine(*checkpoint, **{field: value})


def test_host_tables_are_read_into_host_memory_and_never_copied(checkpoint, monkeypatch):
    """The loader gets the Engram tables' names to keep in host memory (so the release's tables never
    pass through the device), and the tables the layers gather from are those tensors themselves."""
    from deepinfer_core.models.deepseek_v41 import weights as v41_weights

    asked, load = [], v41_weights.load_v41_checkpoint

    def spy(*args, host=(), **kwargs):
        asked.append(set(host))
        return load(*args, host=host, **kwargs)

    monkeypatch.setattr(v41_weights, "load_v41_checkpoint", spy)
    directory = checkpoint[0]  # read from its files, as a served checkpoint is
    engine = make_engine(directory, {}, engram_placement="host", engram_prefetch=False, **OPTIONS)
    model = engine.runner.model
    expected = {f"layers.{i}.engram.embed.{part}" for i in model.tables for part in ("weight", "scale")}
    assert asked == [expected] and len(expected) == 2 * len(model.config.engram_layer_ids)
    for i, table in model.tables.items():
        embed = model.layers[i].engram.embed
        assert table.weight.data_ptr() == embed.weight.data_ptr() and table.scale.data_ptr() == embed.scale.data_ptr()
        assert table.weight.device.type == "cpu"
    engine.shutdown()
    make_engine(directory, {}, **OPTIONS).shutdown()
    assert asked[-1] == set()  # tables on the device: nothing kept back


@pytest.mark.parametrize("prefetch", [True, False])
def test_layer_ops_that_read_host_rows_serve_the_tables_graph_safe(checkpoint, on_device, monkeypatch, prefetch):
    """Reference layer ops given a `gather_host_rows` (as the NVIDIA plugin's have) become the tables'
    reader: every row of every step comes through it, the model lists no graph-unsafe host tables,
    and the tokens and logprobs equal the tables' on the device."""
    from deepinfer_core.backends import HostRowGather
    from deepinfer_core.models.deepseek_v41.engram_prefetch import DeviceReadPrefetcher
    from deepinfer_core.models.deepseek_v41.model import HOST_ENGRAM_TABLES
    from deepinfer_core.reference.layer_ops import ReferenceLayerOps

    reads = []

    def gather_host_rows(self, table, ids, out=None):
        reads.append(tuple(ids.shape))
        rows = table[ids]
        return rows if out is None else out.copy_(rows)

    monkeypatch.setattr(ReferenceLayerOps, "gather_host_rows", gather_host_rows, raising=False)
    recorder = Recorder(monkeypatch)
    engine = make_engine(*checkpoint, engram_placement="host", engram_prefetch=prefetch, **OPTIONS)
    model = engine.runner.model
    assert isinstance(model.ops, HostRowGather)
    assert all(t.reader is model.ops and t.graph_safe for t in model.tables.values())
    assert HOST_ENGRAM_TABLES not in model.backends()
    assert isinstance(model.prefetcher, DeviceReadPrefetcher) if prefetch else model.prefetcher is None
    assert greedy_tokens_and_logprobs(engine, PROMPTS, 4) == on_device
    assert recorder.threads == [] and len(reads) >= 2 * 2 * len(model.tables)  # values and scales, per step
    assert (recorder.num_lookups > 0) != prefetch  # prefetch: launched at the step's start, not at the layer
    engine.shutdown()
