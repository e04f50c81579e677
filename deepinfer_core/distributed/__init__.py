"""Ranks working together: process groups, context parallelism and expert parallelism.

Owns building the torch.distributed groups of a layout (`groups.py`), context-parallel prefill
(`context_parallel.py`, `context_parallel_ops.py`) and expert placement with EPLB (`eplb_state.py`,
`expert_moves.py`). The layout itself (`ParallelConfig`) and each rank's view of its groups
(`ParallelGroups`) are contracts in `deepinfer_core.config` and `deepinfer_core.backends.parallel`.
Imports contracts, `reference`, `plugins` and `models`; never the scheduler, the runner or the engine.
Accelerator twins: the plugins' `distributed.py` (Ascend's HCCL setup).
"""
