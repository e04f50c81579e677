"""HCCL for NPU ranks: the backend string, the rank's device, and the group join (torch.distributed faked)."""

from __future__ import annotations

import sys

import torch
from deepinfer_ascend950 import distributed


def test_process_group_backend_per_device_type():
    assert distributed.process_group_backend(torch.device("npu", 3)) == "cpu:gloo,npu:hccl"
    assert distributed.process_group_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert distributed.process_group_backend(torch.device("cpu")) == "gloo"


def test_rank_device():
    assert distributed.rank_device(torch.device("npu"), 5) == torch.device("npu", 5)
    assert distributed.rank_device(torch.device("cpu"), 5) == torch.device("cpu")


def test_init_npu_group_binds_the_device_then_joins_with_hccl(monkeypatch, doubles):
    npu = doubles.torch_npu_module()
    bound, joined = [], {}
    npu.npu.set_device = bound.append
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kw: joined.update(kw, backend=backend))
    device = distributed.init_npu_group(rank=1, world_size=4, local_rank=1, init_method="tcp://h:1", timeout_s=30)
    assert device == torch.device("npu", 1) and bound == [device]
    assert joined["backend"] == "cpu:gloo,npu:hccl" and (joined["rank"], joined["world_size"]) == (1, 4)
