"""Scheduling: which requests run each step and which cache blocks they hold.

Owns a request's sequence state (`sequence.py`), the block manager (`block_manager.py`: allocation,
reference counts, prefix hashing) and the scheduler that turns the queues into an immutable `StepPlan`
(`scheduler.py`). Imports contracts, `models` and `kv`; never the runner, the executor or the engine.
"""
