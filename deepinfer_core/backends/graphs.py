"""What decode CUDA graphs need from the backends they run: a declaration that capturing them is safe.

The engine captures decode steps as CUDA graphs only when every backend of the model (attention, MoE,
layer ops) declares `supports_cuda_graphs = True`; one that declares False makes decode run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class GraphCapturable(Protocol):
    """A backend that says whether its decode path may be captured in a CUDA graph.

    `AttentionBackend`, `MoEBackend` and `LayerOps` extend it, so every such backend declares it.
    """

    supports_cuda_graphs: bool
    """True when, with `AttentionMetadata.needs_static_shapes` set, a call reads no device value on the
    host (no `.item()`, `.tolist()`, `nonzero`, boolean indexing) and sizes every buffer from shapes and
    host-side bounds only, so its kernels can be captured once and replayed with new inputs."""


def supports_cuda_graphs(backend: object) -> bool:
    """Whether `backend`'s decode path may be captured in a CUDA graph (its declared attribute).

    :raises TypeError: `backend` does not declare `supports_cuda_graphs` (it does not satisfy
        `GraphCapturable`), naming its type.
    """
    if not isinstance(backend, GraphCapturable):
        raise TypeError(f"{type(backend).__qualname__} does not declare supports_cuda_graphs; backends "
                        "built by make_attention, make_moe and make_layer_ops must (see GraphCapturable)")
    return backend.supports_cuda_graphs is True


@dataclass(frozen=True)
class GraphApi:
    """A device's graph-capture API in CUDA's names, which `DecodeGraphs` calls (the `graph_api` hook
    returns one: torch.cuda's on CUDA, torch_npu's `NPUGraph` family on Ascend)."""

    Graph: type
    """The graph class: `Graph()`, then `.replay()` and `.pool()`."""
    graph: Callable
    """Capture context manager: `with graph(g, pool=pool): ...`."""
    Stream: type
    """Side-stream class used for the warm-up runs before a capture."""
    stream: Callable
    """Stream context manager."""
    current_stream: Callable
    """The current stream (`.wait_stream(other)`)."""
    synchronize: Callable
    """Wait for the device."""


def capture_graph(api, forward, pool=None):
    """Run `forward` twice on a side stream (kernels compile, the allocator grows), then capture it into
    a graph of `pool` through the device's `GraphApi`; return the graph and what the captured call returned."""
    stream = api.Stream()
    stream.wait_stream(api.current_stream())
    with api.stream(stream):
        for _ in range(2):
            forward()
    api.current_stream().wait_stream(stream)
    graph = api.Graph()
    with api.graph(graph, pool=pool):
        outputs = forward()
    return graph, outputs
