"""Decode graphs on the NPU: `torch.npu.NPUGraph` behind the seam CUDA graphs use.

The engine's `DecodeGraphs` (deepinfer_core/engine/cuda_graph.py) calls CUDA's graph API by name:
`torch.cuda.CUDAGraph`, `torch.cuda.graph(g, pool=...)`, `torch.cuda.Stream`, `torch.cuda.stream`,
`torch.cuda.current_stream`, `torch.cuda.synchronize`, and `graph.pool()` / `graph.replay()`. torch_npu
offers the same API under `torch.npu` (vllm-ascend's `compilation/acl_graph.py` captures with
`torch.npu.NPUGraph()` inside `torch.npu.graph(g, pool=...)`). `GraphApi` names those six entry points
once; `npu_graph_api` fills it from torch_npu. The core change that would use it (owned by the engine)
is described in the plugin README ("Decode graphs").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(frozen=True)
class GraphApi:
    """A device's graph capture API, in CUDA's names."""

    Graph: type
    """Graph class: `Graph()`, then `.replay()` and `.pool()`."""
    graph: Callable
    """Capture context manager: `with graph(g, pool=pool): ...`."""
    Stream: type
    stream: Callable
    """Stream context manager."""
    current_stream: Callable
    synchronize: Callable


def cuda_graph_api() -> GraphApi:
    """CUDA's API, what `DecodeGraphs` calls today."""
    return GraphApi(Graph=torch.cuda.CUDAGraph, graph=torch.cuda.graph, Stream=torch.cuda.Stream,
                    stream=torch.cuda.stream, current_stream=torch.cuda.current_stream,
                    synchronize=torch.cuda.synchronize)


def npu_graph_api(torch_npu: ModuleType) -> GraphApi:
    """torch_npu's equivalents (`torch_npu.npu` is what torch_npu installs as `torch.npu`).

    :raises AttributeError: this torch_npu lacks one of them, naming it.
    """
    npu = torch_npu.npu
    names = ("NPUGraph", "graph", "Stream", "stream", "current_stream", "synchronize")
    missing = [name for name in names if not hasattr(npu, name)]
    if missing:
        raise AttributeError(f"torch_npu.npu has no {', '.join(missing)}: NPU graph capture needs torch-npu 2.14")
    return GraphApi(Graph=npu.NPUGraph, graph=npu.graph, Stream=npu.Stream, stream=npu.stream,
                    current_stream=npu.current_stream, synchronize=npu.synchronize)


def capture(api: GraphApi, forward: Callable[[], torch.Tensor], pool=None, warmups: int = 2):
    """What `DecodeGraphs.capture` does for one batch size, on any `GraphApi`: warm up on a side stream,
    capture `forward` once; returns `(graph, output)` (replay with `graph.replay()`, which refills
    `output`)."""
    stream = api.Stream()
    stream.wait_stream(api.current_stream())
    with api.stream(stream):
        for _ in range(warmups):
            forward()
    api.current_stream().wait_stream(stream)
    graph = api.Graph()
    with api.graph(graph, pool=pool):
        output = forward()
    return graph, output
