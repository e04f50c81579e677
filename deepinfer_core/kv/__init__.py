"""The KV cache's bytes and where they live beyond the device.

Owns the cache layout (`cache.py`: per-layer pools and per-request rings), a block's bytes as the tiers
see them (`blocks.py`), the pinned host tier (`host_cache.py`), the shared-directory prefix store
(`prefix_store.py`, `store_backends.py`), KV movement between instances over NIXL (`nixl_transfer.py`),
the tiers behind one facade (`tiers.py`), and the KV connector over them: its scheduler half decides
loads, saves, PD export/resume, hit accounting and the SWA-replay range (`connector.py`), its worker half
applies the plan's cache ops (`connector_worker.py`). Imports contracts, `plugins` and `models` (the layer
plan); never the scheduler, the runner or the engine. Accelerator twins: none (tensor copies only).
"""
