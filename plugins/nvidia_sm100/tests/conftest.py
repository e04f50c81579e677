"""Kernel tests need a CUDA device of compute capability >= 9.0; they skip, saying why, elsewhere.

Tests that take `kernel_device` run everywhere: compiled on a suitable GPU, and on the CPU through
Triton's interpreter (`TRITON_INTERPRET=1`, set here before any kernel module is imported; the plugin's
hooks import kernel modules only on a suitable GPU, so nothing else in the process is affected).

The interpreter's `tl.dot` is a NumPy matmul, and OpenBLAS's microkernels give a row other bits at
another position in the tile on some CPUs (its Haswell kernels do). A GPU's MMA computes a row alike
wherever it sits, and the batch-invariance tests rest on that, so under the interpreter each row of a
`tl.dot` is its own product (`_row_by_row_dot`).

The interpreter re-patches `triton.language` on every call of a `@triton.jit` helper inside a kernel,
though the kernel's launch has patched it already, and that took about a quarter of the kernel tests'
time; `_patch_lang_once_a_launch` keeps the launch's patches for the helpers it calls.

Every interpreted op also maps its Triton type to a NumPy dtype by building a dict of 20 types and checks
each block shape it makes (powers of two, the numel cap), about a tenth of the kernel tests' time; both
are pure functions of the type's name and the shape, so `_cache_type_checks` keeps their answers.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from deepinfer_nvidia_sm100.platform import device_problem

if device_problem() is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _row_by_row_dot() -> None:
    """Make the interpreter's `tl.dot` compute each output row alone (see the module's docstring)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    whole = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        rows = [whole(self, interpreter.TensorHandle(a.data[..., i:i + 1, :], a.dtype),
                      b, interpreter.TensorHandle(d.data[..., i:i + 1, :], d.dtype), *args)
                for i in range(a.data.shape[-2])]
        return interpreter.TensorHandle(np.concatenate([r.data for r in rows], axis=-2), rows[0].dtype)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _patch_lang_once_a_launch() -> None:
    """Patch `triton.language` once a kernel launch, not again on each helper call within it (a helper
    that sees a language module not patched yet, as `tl.core` from `tl.sum`, is patched as before)."""
    try:
        from triton import language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = interpreter._patch_lang
    patched: list[set[int]] = []  # the language modules patched by the launch under way, if any

    class LaunchScope:
        def __init__(self, scope, langs: set[int]) -> None:
            self.scope = scope
            patched.append(langs)

        def restore(self) -> None:
            patched.pop()
            self.scope.restore()

    class NoScope:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        langs = {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}
        if not patched:
            return LaunchScope(patch(fn), langs)
        if langs <= patched[-1]:
            return NoScope()
        patched[-1] |= langs  # a helper's patches are not undone before the launch's end (nor after)
        return patch(fn)

    interpreter._patch_lang = patch_lang


def _cache_type_checks() -> None:
    """Remember the interpreter's NumPy dtype of each Triton type (by name, which spells the element type
    and shape) and each block shape's validated numel (see the module's docstring)."""
    try:
        from triton.language import core
        from triton.runtime import interpreter
    except ImportError:
        return
    np_dtype, validate = interpreter._get_np_dtype, core.validate_block_shape
    np_dtypes: dict[str, np.dtype] = {}
    numels: dict[tuple, int] = {}

    def get_np_dtype(tt_dtype):
        name = getattr(tt_dtype, "name", None)
        if name is None:
            return np_dtype(tt_dtype)
        if name not in np_dtypes:
            np_dtypes[name] = np_dtype(tt_dtype)
        return np_dtypes[name]

    def validate_block_shape(shape):
        if type(shape) is not tuple or not all(type(d) is int for d in shape):
            return validate(shape)  # errors (and lists) as before
        if shape not in numels:
            numels[shape] = validate(shape)
        return numels[shape]

    interpreter._get_np_dtype = get_np_dtype
    core.validate_block_shape = validate_block_shape


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_by_row_dot()
    _patch_lang_once_a_launch()
    _cache_type_checks()


@pytest.fixture
def cuda_device() -> torch.device:
    problem = device_problem()
    if problem is not None:
        pytest.skip(f"needs a CUDA device of compute capability >= 9.0 with Triton: {problem}")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def kernel_device() -> torch.device:
    """The GPU when there is a suitable one, else the CPU (kernels then run in Triton's interpreter)."""
    if device_problem() is None:
        return torch.device("cuda", torch.cuda.current_device())
    pytest.importorskip("triton", reason="the kernels' interpreter tests need triton")
    return torch.device("cpu")
