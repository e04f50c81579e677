"""Run a bench script's `main(argv)`, or an example as `__main__`, inside the test process and return what
it printed.

A script run as a subprocess re-imports torch, transformers and the engine (3-6 s a script on the test
machine, more under load); the tests that only read a script's output run it here instead. The
script's module and its sibling modules are imported fresh each call and dropped afterwards, and the global
state a script may change (torch threads, default dtype, RNG states, environment, cwd, logging) is put back,
so the next test sees the process as it was. Tests of a CLI's own behaviour (exit codes, a fresh
interpreter) keep their subprocess."""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import random
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _bench_modules() -> set[str]:
    return {path.stem for path in BENCH.glob("*.py")}


@contextlib.contextmanager
def _restored_state():
    """Put back the process-wide state a bench main may change."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    rng, py_rng = torch.get_rng_state(), random.getstate()
    environ, cwd, argv, path = dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_rng_state(rng)
        random.setstate(py_rng)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.argv[:], sys.path[:] = argv, path
        root.handlers[:] = handlers
        root.setLevel(level)


def run_main(script: str, *argv: str) -> str:
    """`python bench/<script> ARGV...` in this process: the script's stdout (its main must return or exit 0)."""
    name = Path(script).stem
    siblings = _bench_modules()
    saved = {m: sys.modules.pop(m) for m in siblings if m in sys.modules}  # a fresh import, as a new process has
    out = io.StringIO()
    try:
        with _restored_state():
            os.chdir(ROOT)
            sys.path.insert(0, str(BENCH))
            sys.argv[:] = [str(BENCH / f"{name}.py"), *argv]
            module = importlib.import_module(name)
            with contextlib.redirect_stdout(out):
                try:
                    module.main(list(argv))
                except SystemExit as exit_:
                    assert exit_.code in (None, 0), f"bench/{name}.py exited with {exit_.code!r}"
    finally:
        for m in siblings:
            sys.modules.pop(m, None)
        sys.modules.update(saved)
    return out.getvalue()


def run_path(path: Path, *argv: str) -> str:
    """`python PATH ARGV...` in this process, run as `__main__` (an example script): its stdout (it must
    return or exit 0). The environment it should see is set by the caller (e.g. with monkeypatch)."""
    out = io.StringIO()
    with _restored_state():
        os.chdir(ROOT)
        sys.argv[:] = [str(path), *argv]
        sys.path.insert(0, str(Path(path).parent))
        with contextlib.redirect_stdout(out):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as exit_:
                assert exit_.code in (None, 0), f"{path} exited with {exit_.code!r}"
    return out.getvalue()
