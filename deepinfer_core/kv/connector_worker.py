"""The KV connector's worker half: moves the bytes the scheduler half (`kv.connector.KvConnector`)
wrote on the plan.

Each rank's runner applies the plan's `CacheOp`s through it before the step's forward, in order: loads
scatter host bytes into device blocks (or a request's slot), saves start copies to pinned host memory
whose `PendingCopy`s the step result brings back (`StepResult.saved`). The copies themselves are
`kv.blocks.BlockIO`'s; this half is the one door the runner uses, so another transport (a NIXL write
straight from device memory, an NPU copy engine) can replace it without touching the runner.
"""

from __future__ import annotations

from deepinfer_core.kv.blocks import BlockIO, BlockSegment, PendingCopy
from deepinfer_core.models.interface import LayerCache
from deepinfer_core.plan import CacheOp


class KvConnectorWorker:
    """Applies a plan's cache ops to this rank's cache.

    :param layout: the block layout (`kv.blocks.block_layout`), equal on every rank and in the store.
    :param layers: the rank's per-layer cache tensors (`KVCache.layers`).
    """

    def __init__(self, layout: tuple[BlockSegment, ...], layers: list[LayerCache]) -> None:
        self.io = BlockIO(layout, layers)

    @property
    def layout(self) -> tuple[BlockSegment, ...]:
        """The block layout its copies follow."""
        return self.io.layout

    def apply(self, ops: tuple[CacheOp, ...]) -> tuple[PendingCopy, ...]:
        """Run `ops` in order; the pending host copy of each saving op ("save", "save_state"), in order."""
        return self.io.apply(ops)
