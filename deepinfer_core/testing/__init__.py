"""Test support for DeepInfer and its plugins.

- `deepinfer_core.testing.pytest_plugin` (loaded automatically by pytest once `deepinfer` is installed):
  the `isolated_plugin_manager` fixture.
- `deepinfer_core.testing.conformance`: `check_attention`, `check_moe`, `check_sampler`, which compare a
  backend with the reference on random inputs.
- `deepinfer_core.testing.cases`: the reusable random-input builders behind those checks.
"""
