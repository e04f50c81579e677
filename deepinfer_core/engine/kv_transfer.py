"""KV blocks between instances (prefill/decode disaggregation), moved by NIXL.

A prefill instance computes a prompt's blocks, then `KvExporter.export` registers their bytes (from its
host tier) with its NIXL agent and returns a handle: plain JSON (`kv_transfer_params`) naming the
agent (with its metadata), the memory descriptors, and each block's key, parent key and tokens. The
router passes the handle to a decode instance with the request; there `KvImporter.fetch` reads the
blocks with one NIXL READ into host memory (UCX: DRAM to DRAM between processes here; GPU memory and
RDMA in production), checks each block against the request's own key chain, and stages them like a
store read (`PrefixTiers`): the request is admitted with a prefix hit, the windows are rebuilt by
replay, and it decodes. The READ carries a notification with the handle's id, on which the exporter
releases the memory; a handle nobody reads is released after `HANDLE_TTL_S`. A failed read (the
prefill instance died) stages nothing: the decode instance computes the prompt itself.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from deepinfer_core.engine.prefix_tiers import BlockRef

logger = logging.getLogger(__name__)

HANDLE_TTL_S = 120.0
"""A handle no decode instance read within this long is released."""
READ_TIMEOUT_S = 30.0
NIXL_HINT = 'prefill/decode disaggregation needs NIXL: pip install "deepinfer[pd]" (nixl-cu13)'


class KvTransferError(RuntimeError):
    """NIXL is missing, or a transfer failed."""


def _nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:  # the CUDA 13 build alone, without the `nixl` meta package
            from nixl_cu13._api import nixl_agent, nixl_agent_config
        except ImportError as err:
            raise KvTransferError(f"{NIXL_HINT} ({err})") from None
    return nixl_agent, nixl_agent_config


def _agent(role: str):
    nixl_agent, nixl_agent_config = _nixl()
    return nixl_agent(f"deepinfer-{role}-{uuid.uuid4().hex[:12]}", nixl_agent_config(backends=["UCX"]))


@dataclass
class _Export:
    buffer: torch.Tensor
    registration: object
    expires: float
    handle: dict


class KvExporter:
    """The prefill side: blocks exported for decode instances to read (thread-safe)."""

    def __init__(self) -> None:
        self.agent = _agent("prefill")
        self._exports: dict[str, _Export] = {}
        self._lock = threading.Lock()
        self.num_exported = self.num_released = 0

    def export(self, blocks: list[tuple[BlockRef, torch.Tensor]]) -> dict:
        """Register `blocks` (`(ref, [block_bytes] uint8)`, in chain order) and return their handle."""
        self.release_done()
        handle_id = uuid.uuid4().hex
        if not blocks:
            return {"id": handle_id, "blocks": []}
        buffer = torch.stack([row for _, row in blocks]).contiguous()
        with self._lock:  # one thread at a time in the agent (the engine thread exports, the server reads)
            registration = self.agent.register_memory(buffer)
            descs = self.agent.get_xfer_descs(buffer)
            handle = {
                "id": handle_id, "agent": self.agent.name,
                "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "descs": base64.b64encode(self.agent.get_serialized_descs(descs)).decode(),
                "block_bytes": buffer.shape[1],
                "blocks": [[ref.key.hex(), ref.parent.hex(), list(ref.tokens)] for ref, _ in blocks],
            }
            self._exports[handle_id] = _Export(buffer, registration, time.monotonic() + HANDLE_TTL_S, handle)
            self.num_exported += 1
        return handle

    def handle(self, handle_id: str) -> dict | None:
        """The full handle of a pending export (decode instances fetch it by id), or None."""
        self.release_done()
        with self._lock:
            export = self._exports.get(handle_id)
            return None if export is None else export.handle

    def release_done(self) -> None:
        """Release the exports a decode instance finished reading (its notification) or that expired."""
        now = time.monotonic()
        with self._lock:
            done = {msg.decode() for msgs in self.agent.get_new_notifs().values() for msg in msgs}
            for handle_id in [h for h, e in self._exports.items() if h in done or e.expires < now]:
                self.agent.deregister_memory(self._exports.pop(handle_id).registration)
                self.num_released += 1

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._exports)


class KvImporter:
    """The decode side: reads exported blocks (called from the prefix tiers' loader thread)."""

    def __init__(self) -> None:
        self.agent = _agent("decode")
        self._remotes: set[str] = set()
        self.num_fetched = self.num_failed = 0
        self.bytes_read = 0

    def fetch(self, source: dict, chain: list[BlockRef]) -> list[tuple[BlockRef, torch.Tensor]]:
        """The blocks of `source` (`{"prefill": base URL, "id": handle id}`, `kv_transfer_params`) that
        equal `chain` from its first block, read by NIXL; [] on any failure (the caller computes them)."""
        try:
            handle = _fetch_handle(source)
        except (OSError, ValueError, KeyError, TypeError) as err:
            self.num_failed += 1
            logger.warning("no KV handle from the prefill instance %s (%s); the decode instance computes the prompt",
                           source.get("prefill"), err)
            return []
        refs = []
        for ref, (key, parent, tokens) in zip(chain, handle.get("blocks", [])):
            if (ref.key.hex(), ref.parent.hex(), list(ref.tokens)) != (key, parent, tokens):
                break
            refs.append(ref)
        if not refs:
            return []
        try:
            rows = self._read(handle, len(refs))
        except (KvTransferError, RuntimeError, ValueError, KeyError) as err:
            self.num_failed += 1
            logger.warning("reading KV blocks from %s failed (%s); the decode instance computes the prompt",
                           handle.get("agent"), err)
            return []
        self.num_fetched += len(refs)
        self.bytes_read += rows.numel()
        return list(zip(refs, rows))

    def _read(self, handle: dict, count: int) -> torch.Tensor:
        name = handle["agent"]
        if name not in self._remotes:
            self.agent.add_remote_agent(base64.b64decode(handle["metadata"]))
            self._remotes.add(name)
        remote = self.agent.deserialize_descs(base64.b64decode(handle["descs"]))
        buffer = torch.empty(len(handle["blocks"]), int(handle["block_bytes"]), dtype=torch.uint8)
        registration = self.agent.register_memory(buffer)
        try:
            local = self.agent.get_xfer_descs(buffer)
            xfer = self.agent.initialize_xfer("READ", local, remote, name, handle["id"].encode())
            state, deadline = self.agent.transfer(xfer), time.monotonic() + READ_TIMEOUT_S
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise KvTransferError(f"no answer from {name} within {READ_TIMEOUT_S:g} s")
                time.sleep(0.0005)
                state = self.agent.check_xfer_state(xfer)
            self.agent.release_xfer_handle(xfer)
            if state == "ERR":
                raise KvTransferError(f"the NIXL read from {name} failed")
        finally:
            self.agent.deregister_memory(registration)
        return buffer[:count].clone()


def _fetch_handle(source: dict) -> dict:
    import httpx

    response = httpx.get(f"{source['prefill'].rstrip('/')}/v1/pd/handles/{source['id']}", timeout=READ_TIMEOUT_S)
    response.raise_for_status()
    return response.json()


def export_prompt(engine, prompt_token_ids: list[int]) -> dict:
    """On the engine's thread, after the prompt ran: export its full blocks (from the host tier) and
    return the handle (`KvExporter.export`)."""
    tiers = engine.prefix_tiers
    if tiers is None or tiers.exporter is None or tiers.host is None:
        raise KvTransferError("this engine exports no blocks: start it with kv_transfer_role='prefill' (--role prefill)")
    engine.flush_cache_ops()
    blocks = []
    for ref in engine.block_manager.block_refs(prompt_token_ids):
        row = tiers.host.get(ref.key, ref.parent, ref.tokens)
        if row is None:
            break
        blocks.append((ref, row))
    return tiers.exporter.export(blocks)
