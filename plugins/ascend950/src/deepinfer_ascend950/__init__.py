"""DeepInfer plugin for Huawei Ascend 950 NPUs. The hooks live in `deepinfer_ascend950.hooks`."""
