"""A safetensors file's header, read with bounds and checked before the file is opened for its weights.

The safetensors library refuses most broken files, but with messages that name neither the file nor,
often, the tensor, and a header length past the file's end used to reach a read of that many bytes
(a `MemoryError` with no message). `check_header` reads the 8-byte length, refuses one larger than the
file or than the library's own limit, parses the JSON, and checks every tensor's entry: a known dtype,
a shape of non-negative integers, data offsets inside the file's data, exactly as many bytes as the
dtype and shape need, no two tensors sharing bytes, and no bytes that no tensor covers (a truncated or
padded file). Each failure is one `CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from deepinfer_core.config import CheckpointError

MAX_HEADER_BYTES = 100_000_000
"""The safetensors library's own bound on a header."""
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4,
    "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip
"""Bits per element of every dtype a safetensors header may name."""


def check_header(path: Path) -> dict[str, dict]:
    """`path`'s tensor entries (name -> {"dtype", "shape", "data_offsets"}), checked as the module
    docstring says.

    :raises CheckpointError: naming the file, and the tensor where one is at fault.
    """
    header, num_data_bytes = _read_header(path)
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = _check_entry(path, name, entry, num_data_bytes)
        spans.append((begin, end, name))
    spans.sort()
    covered = 0
    for index, (begin, end, name) in enumerate(spans):
        if begin < covered:
            other = next(n for b, e, n in spans[:index] if e > begin)
            raise _bad(path, f"tensors {other} and {name} overlap in the file's data (corrupt header)")
        if begin > covered:
            raise _bad(path, f"data bytes [{covered}, {begin}) before tensor {name} belong to no "
                                  "tensor (corrupt header)")
        covered = end
    if covered != num_data_bytes:
        raise _bad(path, f"the file holds {num_data_bytes} data bytes but its tensors cover {covered} "
                              "(truncated, or padded with bytes no tensor owns)")
    return {name: entry for name, entry in header.items() if name != "__metadata__"}


def _read_header(path: Path) -> tuple[dict, int]:
    """The parsed header and the number of data bytes after it."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _bad(path, f"{size} bytes, too short for a safetensors file (truncated?)")
            length = struct.unpack("<Q", prefix)[0]
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise _bad(path, f"its header length {length} exceeds the file's {size} bytes or the "
                                      f"{MAX_HEADER_BYTES}-byte limit (not safetensors, or corrupt)")
            raw = f.read(length)
    except OSError as err:
        raise _bad(path, f"cannot be read ({err})") from err
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise _bad(path, f"its header is not valid JSON ({type(err).__name__}: {err})") from None
    if not isinstance(header, dict):
        raise _bad(path, "its header is not a JSON object")
    return header, size - 8 - length


def _bad(path: Path, detail: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a readable safetensors file: {detail}")


def _check_entry(path: Path, name: str, entry, num_data_bytes: int) -> tuple[int, int]:
    """Tensor `name`'s `(begin, end)` data offsets, after checking its entry."""
    if not isinstance(entry, dict):
        raise _bad(path, f"tensor {name}'s header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise _bad(path, f"tensor {name} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(path, f"tensor {name} has shape {shape!r}, not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise _bad(path, f"tensor {name} has data_offsets {offsets!r}, not [begin, end] with "
                              "0 <= begin <= end")
    begin, end = offsets
    if end > num_data_bytes:
        raise _bad(path, f"tensor {name}'s bytes [{begin}, {end}) run past the file's {num_data_bytes} "
                              "data bytes (truncated?)")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits != 8 * (end - begin):
        raise _bad(path, f"tensor {name} is {dtype} of shape {shape}, {bits / 8:g} bytes, but its "
                              f"data_offsets give {end - begin} bytes")
    return begin, end
