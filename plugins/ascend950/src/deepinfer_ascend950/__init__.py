"""DeepInfer plugin for Huawei Ascend 950 NPUs (torch_npu and CANN's cann_ops_transformer).

The hooks live in `deepinfer_ascend950.hooks` (entry point `ascend950` in group `deepinfer`); torch_npu
and cann_ops_transformer are imported only once an NPU is asked for. `deepinfer-ascend950 doctor` (or
`python -m deepinfer_ascend950.check`) runs the conformance suite on the NPU and reports each op path.
"""

__version__ = "0.2.0"
