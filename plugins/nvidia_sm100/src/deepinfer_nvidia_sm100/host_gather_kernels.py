"""Rows of a table in pinned host memory gathered by a device kernel (`HostRowGather`).

Pinned host memory is mapped into the device's address space (unified addressing), so a kernel can load
from it over the host link like from its own memory: one program per index copies one row, in the
widest word that divides the row and both pointers' alignment. No host step, so CUDA graphs capture it;
the table's pointer is fixed for the table's life, which is what a replay needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


@triton.jit
def _gather_rows_kernel(table_ptr, ids_ptr, out_ptr, width, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(ids_ptr + i).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for start in range(0, width, BLOCK):
        c = start + cols
        mask = c < width
        tl.store(out_ptr + i * width + c, tl.load(table_ptr + row * width + c, mask=mask), mask=mask)


def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`table[ids]` on `ids`' device, `table` `[rows, width]` in pinned host memory (on the CPU, under
    Triton's interpreter, any host tensor)."""
    if table.dim() != 2 or table.device.type != "cpu" or not table.is_contiguous():
        raise ValueError(f"gather_rows reads a contiguous 2-D host table (a copy would move the whole table), "
                         f"got shape {tuple(table.shape)} on {table.device}")
    if ids.device.type == "cuda" and not table.is_pinned():
        raise ValueError("gather_rows reads a table in pinned host memory (the device cannot map pageable memory)")
    if ids.dtype != torch.int64:
        raise ValueError(f"gather_rows takes int64 row indices, got {ids.dtype}")
    shape = (*ids.shape, table.shape[1])
    if out is None:
        out = torch.empty(shape, dtype=table.dtype, device=ids.device)
    elif tuple(out.shape) != shape or out.dtype != table.dtype or not out.is_contiguous():
        raise ValueError(f"gather_rows' out must be contiguous {shape} {table.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    flat = ids.reshape(-1)
    if flat.numel() == 0:
        return out
    row_bytes = table.shape[1] * table.element_size()
    word = next(w for w in WORDS if row_bytes % w.itemsize == 0 and table.data_ptr() % w.itemsize == 0
                and out.data_ptr() % w.itemsize == 0)
    words = table.view(torch.uint8).view(word)
    dst = out.view(-1, table.shape[1]).view(torch.uint8).view(word)
    width = words.shape[1]
    _gather_rows_kernel[(flat.numel(),)](words, flat, dst, width, BLOCK=min(triton.next_power_of_2(width), 1024))
    return out
