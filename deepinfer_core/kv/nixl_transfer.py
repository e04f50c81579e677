"""KV blocks and request state between instances (prefill/decode disaggregation), moved by NIXL.

A prefill instance computes a prompt and samples its first token, then `export_prompt` registers, with
its NIXL agent, one buffer holding the prompt's full blocks (from its host tier) followed by the
request's state (its slot's window rings and compressor tails, and its partial last block: see
`kv_blocks`), and returns a handle: plain JSON (`kv_transfer_params`) naming the agent (with its
metadata), the exported region (address, size, device, memory type), each block's key, parent key and
tokens, the state's size and the first token. The router passes the handle to a decode instance with the request; there the engine
appends the first token at once (`Engine.add_request`), `KvImporter.fetch` reads the buffer with one
NIXL READ into host memory (UCX: DRAM to DRAM between processes here; GPU memory and RDMA in
production), checks each block against the request's own key chain, and stages blocks and state like
a store read (`PrefixTiers`): the request is admitted with its whole prompt computed and decodes from
the first token, with no replay and no prompt token computed. The READ carries a notification with the
handle's id, on which the exporter releases the memory; a handle nobody reads is released after
`HANDLE_TTL_S`. A failed read (the prefill instance died) stages nothing: the decode instance computes
the prompt itself (the first token, already known, is computed as part of it).

The handle is read only from the prefill instances the decode instance was given, with the instance
key's credential, bounded in size and time, and checked field by field (`kv.pd_handle`); the exported
buffer travels as plain numbers (address, size, device, memory type), never pickled. Whatever a
handle holds, a bad one is a warning and a count (`num_failed`) and the prompt is computed here.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from deepinfer_core.kv.pd_handle import Handle, HandleClient, KvTransferError, parse_handle, read_handle
from deepinfer_core.kv.tiers import BlockRef
from deepinfer_core.plugins import install_hint
from deepinfer_core.sampling_params import KvTransferParams

logger = logging.getLogger(__name__)

HANDLE_TTL_S = 120.0
"""A handle no decode instance read within this long is released."""
READ_TIMEOUT_S = 30.0
NIXL_HINT = f"prefill/decode disaggregation needs NIXL (nixl-cu13): {install_hint('pd')}"


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

    def export(self, blocks: list[tuple[BlockRef, torch.Tensor]], state: torch.Tensor | None = None,
               extra: dict | None = None) -> dict:
        """Register `blocks` (`(ref, [block_bytes] uint8)`, in chain order) and the request's `state`
        (uint8 bytes, or None) as one buffer and return their handle (`extra` is copied into it)."""
        self.release_done()
        handle_id = uuid.uuid4().hex
        parts = [row.reshape(-1) for _, row in blocks] + ([state.reshape(-1)] if state is not None else [])
        handle = {"id": handle_id, "blocks": [[ref.key.hex(), ref.parent.hex(), list(ref.tokens)] for ref, _ in blocks],
                  "block_bytes": int(blocks[0][1].numel()) if blocks else 0,
                  "state_bytes": int(state.numel()) if state is not None else None, **(extra or {})}
        if not parts:
            return handle
        buffer = torch.cat(parts).contiguous()
        with self._lock:  # one thread at a time in the agent (the engine thread exports, the server reads)
            registration = self.agent.register_memory(buffer)
            device = buffer.get_device()
            region = [buffer.data_ptr(), int(buffer.numel()), max(device, 0), "VRAM" if device >= 0 else "DRAM"]
            handle.update(agent=self.agent.name, metadata=base64.b64encode(self.agent.get_agent_metadata()).decode(),
                          region=region)
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
    """The decode side: reads exported blocks (called from the prefix tiers' loader thread).

    `client` says which prefill instances it reads from and how (`pd_handle.HandleClient`); until the
    server sets it, no handle is read."""

    def __init__(self, client: HandleClient | None = None) -> None:
        self.agent = _agent("decode")
        self.client = client
        self.num_fetched = self.num_failed = 0
        self.bytes_read = 0

    def fetch(self, source: KvTransferParams, chain: list[BlockRef]) -> tuple[list[tuple[BlockRef, torch.Tensor]],
                                                                   tuple[int, torch.Tensor] | None]:
        """The blocks of `source` (`SamplingParams.kv_transfer_params`: the base URL and handle id) that
        equal `chain` from its first block, read by NIXL, and the request's state `(prompt length, bytes)`
        when every block matched (else None); `([], None)` on any failure (the caller computes them).
        Never raises: its result is taken on the engine's thread, where an exception would stop it."""
        try:
            return self._fetch(source, chain)
        except Exception as err:  # noqa: BLE001 - whatever a handle holds, the prompt is computed here instead
            self.num_failed += 1
            logger.warning("KV transfer from the prefill instance %r refused or failed (%s); the decode instance "
                           "computes the prompt", source.prefill, f"{type(err).__name__}: {err}"[:300])
            return [], None

    def _fetch(self, source: KvTransferParams, chain: list[BlockRef]):
        client = self.client or HandleClient()
        handle = parse_handle(_fetch_handle(source, self.client, len(chain)), source.id, len(chain), client)
        refs = []
        for ref, (key, parent, tokens) in zip(chain, handle.blocks):
            if (ref.key.hex(), ref.parent.hex(), list(ref.tokens)) != (key, parent, tokens):
                break
            refs.append(ref)
        has_state = handle.state_bytes is not None and len(refs) == len(handle.blocks)
        if not refs and not has_state:
            return [], None
        data = self._read(handle)
        block_bytes, num_blocks = handle.block_bytes, len(handle.blocks)
        rows = data[: num_blocks * block_bytes].view(num_blocks, block_bytes)[: len(refs)].clone()
        self.num_fetched += len(refs)
        self.bytes_read += data.numel()
        state = (handle.num_prompt_tokens, data[num_blocks * block_bytes :].clone()) if has_state else None
        return list(zip(refs, rows)), state

    def _read(self, handle: Handle) -> torch.Tensor:
        name = handle.agent
        # the metadata names the memory registered when it was taken: load it afresh for each handle
        self.agent.add_remote_agent(base64.b64decode(handle.metadata, validate=True))
        address, size, device, memory = handle.region
        remote = self.agent.get_xfer_descs([(address, size, device)], memory)
        buffer = torch.empty(size, dtype=torch.uint8)
        registration = self.agent.register_memory(buffer)
        try:
            local = self.agent.get_xfer_descs(buffer)
            xfer = self.agent.initialize_xfer("READ", local, remote, name, handle.id.encode())
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
        return buffer


def first_token_of(params, vocab_size: int) -> int | None:
    """The first token a prefill instance sampled for this request (`kv_transfer_params.first_token`),
    or None. :raises ValueError: not a token id, or a request it cannot continue (only n=1 without
    logprobs, prompt logprobs or structured output: the prefill instance sends none for the others)."""
    kv = getattr(params, "kv_transfer_params", None)
    token = kv.first_token if kv is not None else None
    if token is None:
        return None
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
        raise ValueError(f"kv_transfer_params first_token must be a token id in [0, {vocab_size}), got {token!r}")
    if not continues_from_first_token(params):
        raise ValueError("a first token from a prefill instance is only for n=1 without logprobs, prompt "
                         "logprobs or structured output; leave kv_transfer_params first_token out")
    return token


def continues_from_first_token(params) -> bool:
    """Whether a decode instance can continue `params`' request from the first token the prefill
    instance sampled (see `first_token_of`)."""
    return (params.n == 1 and params.logprobs is None and params.prompt_logprobs is None
            and not params.structured_outputs)


def first_token_output(token: int):
    """A one-row `SamplerOutput` of `token`, as if the engine had sampled it (its logprobs unreported)."""
    from deepinfer_core.backends import SamplerOutput

    return SamplerOutput(token_ids=torch.tensor([token]), logprobs=torch.zeros(1),
                         ranks=torch.ones(1, dtype=torch.long))


def _fetch_handle(source: KvTransferParams, client: HandleClient | None, num_blocks: int) -> object:
    """The handle `source` names, decoded (`pd_handle.read_handle`; tests stand in for it)."""
    return read_handle(source, client, num_blocks)


def export_prompt(engine, prompt_token_ids: list[int], request_id: str, first_token: int | None,
                  images=()) -> dict:
    """On the engine's thread, after the prompt of `request_id` ran: export its full blocks (from the host
    tier) and its state, and return the handle (`KvExporter.export`); `first_token`: the token it
    sampled, sent on for the decode instance to continue from (None: the decode instance computes the
    prompt's last token itself, so the state is not sent); `images`: the prompt's images (`ImageInput`s),
    whose content the blocks' keys cover."""
    tiers = engine.prefix_tiers
    if tiers is None or tiers.exporter is None or tiers.host is None:
        raise KvTransferError("this engine exports no blocks: start it with kv_transfer_role='prefill' (--role prefill)")
    engine.flush_cache_ops()
    state = tiers.pop_state(request_id)
    blocks = []
    # the blocks below the first token: every full block of the prompt
    for ref in engine.kv_connector.block_refs([*prompt_token_ids, 0], images):
        row = tiers.host.get(ref.key, ref.parent, ref.tokens)
        if row is None:
            state = None  # the decode instance can use the state only on top of every block
            break
        blocks.append((ref, row))
    if first_token is None:
        state = None
    return tiers.exporter.export(blocks, state, {"num_prompt_tokens": len(prompt_token_ids), "first_token": first_token})
