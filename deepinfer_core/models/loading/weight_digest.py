"""A hash of the weights' bytes, taken as the loader reads them: the weights part of the cache fingerprint.

The prefix cache keys every block by a chain rooted at the cache fingerprint (`interface.cache_fingerprint`),
so two checkpoints whose weights differ must never share a fingerprint, even when their file names,
sizes and safetensors headers are identical (a fine-tune, a rescaled copy). Hashing the files a second
time would double the load's reads; instead `SafetensorsReader` hands every tensor (or tensor-parallel
slice) it reads to `WeightDigest.add`, which hashes the raw stored bytes (before any dequantisation or
cast) with SHA-256 on a few threads (hashlib releases the GIL on large buffers, so hashing overlaps the
reads). SHA-256 rather than BLAKE2b: OpenSSL's uses the CPU's SHA instructions (x86 SHA-NI, Arm SHA2),
1.6-2.8x BLAKE2b's rate on this project's shared 2-core machine (`bench/RESULTS.md`), and it stays a
cryptographic hash, so no checkpoint can be made to collide with another's keys. `digest()` joins the
per-tensor digests in name order, so the result does not depend on the order tensors were read in or
on which thread hashed them.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

MAX_PENDING_BYTES = 1 << 30
"""Bytes read but not yet hashed before `add` waits for the hashing threads (bounds the extra memory)."""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements as raw bytes in row-major order, on the host."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


def _hash(data: memoryview) -> bytes:
    return hashlib.sha256(data).digest()


class WeightDigest:
    """Per-tensor SHA-256 digests of the bytes read, joined into one (see the module docstring).

    :param num_threads: hashing threads (default: up to 8, at most the host's cores).
    """

    def __init__(self, num_threads: int | None = None) -> None:
        self._num_threads = num_threads or max(1, min(8, os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._entries: dict[str, tuple[str, Future | bytes]] = {}
        self._pending: deque[tuple[Future, int]] = deque()
        self._pending_bytes = 0
        self.num_bytes = 0
        """Bytes hashed (each tensor or slice once, however often it was read)."""

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Hash `tensor`'s bytes as the entry `key` (a tensor name, with the slice read for a partial
        read); a key already added is not hashed again (the same bytes, read twice)."""
        if key in self._entries:
            return
        data = tensor_bytes(tensor)
        meta = f"{tensor.dtype}:{tuple(tensor.shape)}"
        self.num_bytes += data.nbytes
        if data.nbytes < (1 << 16):  # small tensors: a thread hop costs more than the hash
            self._entries[key] = (meta, _hash(data))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="deepinfer-weight-hash")
        future = self._pool.submit(_hash, data)  # `data` keeps the tensor's memory alive until hashed
        self._entries[key] = (meta, future)
        self._pending.append((future, data.nbytes))
        self._pending_bytes += data.nbytes
        while self._pending_bytes > MAX_PENDING_BYTES and self._pending:
            done, num_bytes = self._pending.popleft()
            done.result()
            self._pending_bytes -= num_bytes

    def digest(self) -> bytes:
        """The digest over every entry so far (name order), after waiting for the hashing threads."""
        total = hashlib.sha256()
        for key in sorted(self._entries):
            meta, value = self._entries[key]
            value = value.result() if isinstance(value, Future) else value
            total.update(f"{key}|{meta}|".encode() + value)
        self._pending.clear()
        self._pending_bytes = 0
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        return total.digest()


def tensors_digest(weights: dict[str, torch.Tensor]) -> bytes:
    """The digest of in-memory weights (every byte of every tensor), as a loader reading them would take it."""
    digest = WeightDigest()
    for name, tensor in weights.items():
        digest.add(name, tensor)
    return digest.digest()
