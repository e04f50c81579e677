"""The model side of one rank: the runner that owns the device, the weights and the cache.

Owns the model runner (`runner.py`), which runs each `StepPlan` and samples; its persistent batch
(`input_batch.py`: per-request states, flat step inputs, the `ForwardContext`); its build phases
(`model_loader.py`: weights, backends, cache sizing, the MTP drafter, graph capture); and the decode
CUDA graphs (`graphs.py`). Helpers get the objects they need (model, cache, input batch), never the
runner. Imports contracts, `plugins`, `models`, `kv`,
`distributed`, `speculative` and `structured_output` (their worker halves); never the scheduler's
state, the executor or the engine. Accelerator twins: the plugins' `graphs.py`.
"""
