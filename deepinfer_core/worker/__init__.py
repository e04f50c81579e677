"""The model side of one rank: the runner that owns the device, the weights and the cache.

Owns the model runner (`runner.py`), which turns each `StepPlan` into flat inputs, runs the model
and samples, and the decode CUDA graphs (`graphs.py`). Imports contracts, `plugins`, `models`, `kv`,
`distributed`, `speculative` and `structured_output` (their worker halves); never the scheduler's
state, the executor or the engine. Accelerator twins: the plugins' `graphs.py`.
"""
