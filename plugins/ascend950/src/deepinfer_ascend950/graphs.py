"""Decode graphs on the NPU: `torch.npu.NPUGraph` behind the seam CUDA graphs use.

The engine's `DecodeGraphs` (deepinfer_core/engine/cuda_graph.py) captures through the `GraphApi` the
`graph_api` hook returns (`deepinfer_core.backends.GraphApi`, in CUDA's names). torch_npu offers the same
API under `torch.npu` (vllm-ascend's `compilation/acl_graph.py` captures with `torch.npu.NPUGraph()`
inside `torch.npu.graph(g, pool=...)`); `npu_graph_api` fills a `GraphApi` from it, and `capture` is the
engine's own `capture_graph` on it.
"""

from __future__ import annotations

from types import ModuleType

from deepinfer_core.backends import GraphApi
from deepinfer_core.backends.graphs import capture_graph as capture  # noqa: F401 (the plugin's check captures through it)


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
