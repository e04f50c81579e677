"""The KV cache's bytes and where they live beyond the device.

Owns the cache layout (`cache.py`: per-layer pools and per-request rings), a block's bytes as the tiers
see them (`blocks.py`), the pinned host tier (`host_cache.py`), the shared-directory prefix store
(`prefix_store.py`, `store_backends.py`), KV movement between instances over NIXL (`nixl_transfer.py`)
and the tiers behind one facade (`tiers.py`). Imports contracts, `plugins` and `models` (the layer
plan); never the scheduler, the runner or the engine. Accelerator twins: none (tensor copies only).
"""
