"""Executors: how a `StepPlan` reaches the ranks that run it.

Owns the executor protocol and the in-process, multi-process and torchrun executors
(`executor.py`), and the worker-rank process side (`worker.py`). Imports everything below it (the
runner, the parallel groups); never the engine.
"""
