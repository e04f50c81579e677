"""Executors: how a `StepPlan` reaches the ranks that run it.

Owns the executor protocol (`protocol.py`), the in-process (`uni.py`), multi-process (`mp.py`) and
torchrun (`torchrun.py`) executors, `make_executor` (`factory.py`), and the worker-rank process side
(`worker.py`). Imports everything below it (the runner, the parallel groups); never the engine.
"""
