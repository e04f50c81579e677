"""Rows of a pinned host table read by the device (`host_gather_kernels`, the layer ops' `HostRowGather`):
equal to `index_select` for any row width and word size, into `out` or a new tensor, inside a CUDA graph
too; wrong inputs are errors that say what is wrong. The engine test: a tiny DeepSeek-V4.1 model with its
Engram tables in host memory keeps CUDA-graph decode and gives the tokens of tables on the device."""

from __future__ import annotations

import pytest
import torch


def host_table(rows: int, width: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    table = torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return table.pin_memory() if device.type == "cuda" else table


@pytest.mark.parametrize("width", [256, 8, 6, 3])  # int64, int64, int16, uint8 words
def test_gathered_rows_equal_index_select(kernel_device, width):
    from deepinfer_nvidia_sm100.host_gather_kernels import gather_rows

    table = host_table(1000, width, kernel_device)
    ids = torch.randint(0, 1000, (5, 24), generator=torch.Generator().manual_seed(1))
    got = gather_rows(table, ids.to(kernel_device))
    assert got.device == kernel_device and got.shape == (5, 24, width)
    assert torch.equal(got.cpu(), table[ids])
    out = torch.zeros(5, 24, width, dtype=torch.uint8, device=kernel_device)
    assert gather_rows(table, ids.to(kernel_device), out) is out and torch.equal(out.cpu(), table[ids])
    assert gather_rows(table, ids[:0].to(kernel_device)).shape == (0, 24, width)


def test_bad_inputs_say_what_is_wrong(kernel_device):
    from deepinfer_nvidia_sm100.host_gather_kernels import gather_rows

    table, ids = host_table(10, 8, kernel_device), torch.zeros(3, dtype=torch.long, device=kernel_device)
    with pytest.raises(ValueError, match="int64"):
        gather_rows(table, ids.int())
    with pytest.raises(ValueError, match="2-D host table"):
        gather_rows(table[0], ids)
    with pytest.raises(ValueError, match="out must be contiguous"):
        gather_rows(table, ids, torch.empty(3, 4, dtype=torch.uint8, device=kernel_device))
    if kernel_device.type == "cuda":
        with pytest.raises(ValueError, match="pinned"):
            gather_rows(torch.zeros(10, 8, dtype=torch.uint8), ids)


def test_a_cuda_graph_replays_the_gather_with_new_ids(cuda_device):
    from deepinfer_nvidia_sm100.host_gather_kernels import gather_rows

    table = host_table(4096, 264, cuda_device)
    ids = torch.zeros(16, 24, dtype=torch.long, device=cuda_device)
    out = torch.empty(16, 24, 264, dtype=torch.uint8, device=cuda_device)
    gather_rows(table, ids, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather_rows(table, ids, out)
    for seed in range(3):
        new = torch.randint(0, 4096, (16, 24), generator=torch.Generator().manual_seed(seed))
        ids.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), table[new])


def test_v41_with_host_engram_tables_keeps_graph_decode_and_the_device_tables_tokens(cuda_device, tmp_path):
    from deepinfer_core import SamplingParams
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.engine import Engine
    from deepinfer_core.models.deepseek_v41.engram_prefetch import DeviceReadPrefetcher
    from deepinfer_core.models.v41_tiny import tiny_v41_config, write_v41_checkpoint
    from deepinfer_core.testing.serving import serve

    directory = write_v41_checkpoint(tmp_path / "tiny", tiny_v41_config(), seed=3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 129000, (n,), generator=gen).tolist() for n in (40, 9, 130)]

    def run(**options):
        config = EngineConfig(model=str(directory), dtype="float32", device="cuda", max_num_seqs=4,
                              num_kv_blocks=16, **options)
        engine = Engine(config)
        outputs = serve(engine, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        done = {o.request_id: list(o.outputs[0].token_ids) for o in outputs}
        model, graphs, prefetcher = engine.runner.model, engine.runner.graphs, engine.runner.model.prefetcher
        engine.shutdown()
        return done, model, graphs, prefetcher

    expected, _, device_graphs, _ = run()
    for prefetch in (True, False):
        tokens, model, graphs, prefetcher = run(engram_placement="host", engram_prefetch=prefetch)
        assert {t.placement for t in model.tables.values()} == {"host"}
        assert all(t.weight.is_pinned() and t.graph_safe for t in model.tables.values())
        assert isinstance(prefetcher, DeviceReadPrefetcher) == prefetch
        assert device_graphs is not None and graphs is not None  # decode replays graphs with host tables too
        assert tokens == expected, prefetch
