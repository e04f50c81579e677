"""Scheduling: which requests run each step and which cache blocks they hold.

Owns a request's sequence state (`sequence.py`), the block pool (`block_pool.py`: allocation,
reference counts, prefix hashing, eviction; block 0 is the reserved null block) and the scheduler that turns the queues into an immutable `StepPlan`
(`scheduler.py`). Imports contracts, `models` and `kv`; never the runner, the executor or the engine.
"""
