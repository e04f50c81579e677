"""HCCL as the torch.distributed backend for NPU ranks.

The engine's workers join their group in `deepinfer_core.executor.worker.init_group`, which today picks
`"cpu:gloo,cuda:nccl"` on CUDA and `"gloo"` elsewhere; on the NPU the collectives of the model side
(expert dispatch, all-reduce) must run on HCCL, with gloo kept for the host-side object collectives the
executor uses (`broadcast_object_list`, `gather_object`). `process_group_backend` is that choice for
every device type; the one-line core change is to call it (plugin README, "Several ranks").
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer_ascend950.platform import load_torch_npu

BACKENDS = {"cuda": "cpu:gloo,cuda:nccl", "npu": "cpu:gloo,npu:hccl"}


def process_group_backend(device: torch.device) -> str:
    """The `init_process_group` backend string for ranks on `device`."""
    return BACKENDS.get(device.type, "gloo")


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Rank `local_rank`'s own accelerator (`npu:<local_rank>`, `cuda:<local_rank>`), else `device`."""
    return torch.device(device.type, local_rank) if device.type in BACKENDS else device


def init_npu_group(rank: int, world_size: int, local_rank: int, init_method: str, timeout_s: float) -> torch.device:
    """Bind this process to `npu:<local_rank>` and join the group with HCCL for device tensors.

    :returns: the rank's device.
    """
    device = torch.device("npu", local_rank)
    load_torch_npu().npu.set_device(device)
    dist.init_process_group(process_group_backend(device), init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return device
