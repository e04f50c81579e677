"""What the start-up memory profile reads from a device: its allocator's counters.

The engine sizes its KV cache from what the largest step really allocates: after the weights load it
runs that step once and reads the peak through a `MemoryCounters` (the `memory_counters` hook returns
one; torch.cuda's on NVIDIA, torch_npu's on Ascend). A device without counters (the CPU) keeps the
estimate, and the log says the peak was not measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryCounters:
    """One device's memory counters, in bytes, as functions of no argument (bound to the device)."""

    mem_get_info: Callable[[], tuple[int, int]]
    """`(free, total)` bytes of the device, as the driver sees them (other processes' use included)."""
    allocated: Callable[[], int]
    """Bytes the framework's allocator has handed out now (live tensors)."""
    reserved: Callable[[], int]
    """Bytes the framework's caching allocator holds from the driver (handed out or cached)."""
    peak_allocated: Callable[[], int]
    """The most `allocated` has been since the last `reset_peak`."""
    reset_peak: Callable[[], None]
    """Start a new peak: `peak_allocated` becomes `allocated`."""
    synchronize: Callable[[], None]
    """Wait for the device (queued work allocates when it is queued, but frees may lag)."""
    empty_cache: Callable[[], None]
    """Give the caching allocator's unused blocks back to the driver."""
