"""A decode instance's read of a prefill instance's handle (`GET /pd/handles/{id}`), bounded and checked.

The handle comes over the network, so nothing in it is trusted before it is checked here: it is read
only from a configured prefill instance (`HandleClient.allowed`, compared as normalized base URLs),
with the instance key's credential (`HandleClient.headers_for`), within `HandleClient.timeout_s` (twice
that at worst) and a size bound from the request's own prompt, and parsed into `Handle` field by field: types,
ranges, sizes consistent with this engine's block bytes. Any failure is a `KvTransferError` with one
plain sentence; the importer then computes the prompt locally.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

HANDLE_TIMEOUT_S = 5.0
"""Longest a handle's read may take, connection to last byte (a handle is a few KB from memory)."""
HANDLE_BASE_BYTES = 1 << 20
"""Bytes of a handle besides its blocks (agent metadata, region)."""
HANDLE_BYTES_PER_BLOCK = 256 + 12 * 256
"""Bound on one block's entry in a handle: two hex keys and its tokens."""
MEMORY_TYPES = ("DRAM", "VRAM")


class KvTransferError(RuntimeError):
    """NIXL is missing, or a transfer failed (a handle refused, unreadable or malformed, a read failed)."""


def normalized_url(url: str) -> str:
    """`url` as `scheme://host:port/path` (lowercase host, explicit port, no trailing slash), for
    comparing instance URLs. :raises ValueError: not an http(s) URL with a host."""
    try:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"{url!r} is not a URL ({err})") from None
    if (parsed.scheme not in ("http", "https") or not parsed.hostname or "@" in parsed.netloc or parsed.query
            or parsed.fragment):
        raise ValueError(f"{url!r} is not an http(s) base URL (http://host:port)")
    port = port or (443 if parsed.scheme == "https" else 80)
    return f"{parsed.scheme}://{parsed.hostname.lower()}:{port}{parsed.path.rstrip('/')}"


@dataclass(frozen=True)
class HandleClient:
    """Where and how a decode instance reads handles: the prefill instances it trusts, the credential
    it presents to them, and the bounds of one read."""

    allowed: frozenset[str] = frozenset()
    """Normalized base URLs (`normalized_url`) of the prefill instances handles may come from."""
    headers_for: Callable[[str], dict[str, str]] = field(default=lambda handle_id: {})
    """The headers authenticating the read of handle `id` to the prefill instance."""
    timeout_s: float = HANDLE_TIMEOUT_S
    """Longest wait for the connection, the answer's start or each next chunk; the whole read stops at
    the first chunk past it (so it takes at most twice this)."""
    block_bytes: int | None = None
    """This engine's bytes per block: a handle's must equal it (None: not checked)."""
    state_bytes: Callable[[int], int | None] | None = None
    """Bytes of the state of a request of that many prompt tokens on this engine (None: not checked)."""

    def is_allowed(self, url: str) -> bool:
        """Whether `url` names a prefill instance this decode instance may read from."""
        try:
            return normalized_url(url) in self.allowed
        except ValueError:
            return False


@dataclass(frozen=True)
class Handle:
    """A checked handle: what `KvExporter.export` answers."""

    id: str
    blocks: list[tuple[str, str, list[int]]]
    block_bytes: int
    state_bytes: int | None
    num_prompt_tokens: int
    agent: str = ""
    metadata: str = ""
    region: tuple[int, int, int, str] | None = None
    """(address, bytes, device id, memory type) of the exported buffer; None when nothing was exported."""

    @property
    def num_bytes(self) -> int:
        """Bytes of blocks and state in the exported buffer."""
        return len(self.blocks) * self.block_bytes + (self.state_bytes or 0)


def read_handle(source, client: HandleClient | None, num_blocks: int) -> object:
    """The handle `source` (`KvTransferParams`) names, as decoded JSON (`parse_handle` checks it).

    :param num_blocks: blocks of the request's prompt (bounds the handle's size).
    :raises KvTransferError: the source is not trusted, the read failed or was too slow or too large,
        or the answer is not JSON.
    """
    if client is None or not client.is_allowed(source.prefill):
        raise KvTransferError(f"{source.prefill!r} is not a configured prefill instance")
    max_bytes = HANDLE_BASE_BYTES + (num_blocks + 1) * HANDLE_BYTES_PER_BLOCK
    raw = _read_bounded(f"{source.prefill.rstrip('/')}/pd/handles/{source.id}", client.headers_for(source.id),
                        client.timeout_s, max_bytes)
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as err:  # not JSON, or nested deeper than the parser goes
        raise KvTransferError(f"the handle is not JSON ({type(err).__name__})") from None
    return value


def _read_bounded(url: str, headers: dict[str, str], timeout_s: float, max_bytes: int) -> bytes:
    import httpx  # the pd extra's: only a decode instance reading a handle needs it

    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s), follow_redirects=False) as http, \
                http.stream("GET", url, headers=headers) as response:
            if response.status_code != 200:
                raise KvTransferError(f"the prefill instance answered {response.status_code}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise KvTransferError(f"the handle is larger than {max_bytes} bytes")
            for chunk in response.iter_bytes():  # decoded: a compressed answer is bounded by what it expands to
                size += len(chunk)
                if size > max_bytes:
                    raise KvTransferError(f"the handle is larger than {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise KvTransferError(f"the handle did not arrive within {timeout_s:g} s")
                chunks.append(chunk)
    except httpx.HTTPError as err:  # refused, reset, or a read slower than the timeout
        raise KvTransferError(f"{type(err).__name__}: {err or 'no answer'}") from None
    return b"".join(chunks)


def parse_handle(value: object, handle_id: str, num_blocks: int, client: HandleClient) -> Handle:
    """`value` (decoded JSON) as a `Handle`. :raises KvTransferError: any field missing, of the wrong
    type, out of range, or sizes inconsistent with this engine."""
    if not isinstance(value, dict):
        raise KvTransferError(f"the handle is a JSON {type(value).__name__}, not an object")
    if value.get("id") != handle_id:
        raise KvTransferError("the handle names another id")
    blocks = value.get("blocks")
    if not isinstance(blocks, list) or len(blocks) > num_blocks or not all(_is_block_entry(b) for b in blocks):
        raise KvTransferError(f"the handle's blocks are not a list of at most {num_blocks} [key, parent, tokens]")
    block_bytes, state_bytes = value.get("block_bytes"), value.get("state_bytes")
    num_prompt = value.get("num_prompt_tokens")
    if not (_is_count(block_bytes) and _is_count(num_prompt) and (state_bytes is None or _is_count(state_bytes))):
        raise KvTransferError("the handle's block_bytes, state_bytes or num_prompt_tokens is not a count")
    if blocks and client.block_bytes is not None and block_bytes != client.block_bytes:
        raise KvTransferError(f"the handle's blocks are {block_bytes} bytes, this engine's {client.block_bytes}")
    if state_bytes is not None and not _is_expected_state(state_bytes, num_prompt, client):
        raise KvTransferError(f"the handle's state of {state_bytes} bytes does not fit this engine")
    handle = Handle(handle_id, [(k, p, list(t)) for k, p, t in blocks], block_bytes, state_bytes, num_prompt)
    if not handle.num_bytes:
        return handle
    agent, metadata, region = value.get("agent"), value.get("metadata"), value.get("region")
    if not (isinstance(agent, str) and isinstance(metadata, str) and isinstance(region, list) and len(region) == 4
            and all(_is_count(x) for x in region[:3]) and region[3] in MEMORY_TYPES):
        raise KvTransferError("the handle's agent, metadata or region is malformed")
    if region[1] != handle.num_bytes:
        raise KvTransferError(f"the handle's region is {region[1]} bytes, its blocks and state {handle.num_bytes}")
    return Handle(**{**vars(handle), "agent": agent, "metadata": metadata, "region": tuple(region)})


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _is_block_entry(entry: object) -> bool:
    return (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[1], str)
            and isinstance(entry[2], list) and all(_is_count(t) for t in entry[2]))


def _is_expected_state(state_bytes: int, num_prompt: int, client: HandleClient) -> bool:
    expected = client.state_bytes(num_prompt) if client.state_bytes is not None else None
    return expected is None or state_bytes == expected


__all__ = ["HANDLE_TIMEOUT_S", "Handle", "HandleClient", "KvTransferError", "normalized_url", "parse_handle",
           "read_handle"]
