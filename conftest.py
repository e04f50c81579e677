"""Under pytest-xdist (`-n`, as `nox -s tests` runs), every worker and each process it starts (engine
ranks, bench scripts) run torch on one thread: the workers already share the machine's cores, OpenMP
threads that spin-wait at barriers for a core another worker holds slowed the multi-process tests
several-fold, and the ranks must use the thread count of the worker they are compared with (the
reductions' order, so the bits, follow it)."""

from __future__ import annotations

import os

import torch


def pytest_configure(config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
