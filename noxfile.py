"""Developer sessions: `nox -s tests` (the CI command), `nox -s lint`, `nox -s demo`, `nox -s gpu`,
`nox -s wheels`, `nox -s docs`."""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint"]

TORCH = "torch==2.13.0"  # installed on its own first, so the packages below never pick another build
DISTRIBUTIONS = (".", "plugins/recipe", "plugins/nvidia_sm100", "plugins/ascend950")
"""Source directories of the four distributions: deepinfer, deepinfer-recipe, -nvidia-sm100, -ascend950."""
# the NVIDIA plugin with Triton: off the GPU its kernel tests run in Triton's interpreter
EDITABLE_PACKAGES = ("-e", ".[test]", "-e", "plugins/recipe", "-e", "plugins/nvidia_sm100[triton]",
                     "-e", "plugins/ascend950")


def install(session: nox.Session) -> None:
    """torch first (pinned), then the core and every plugin, editable, with the test extra."""
    session.install(TORCH)
    session.install(*EDITABLE_PACKAGES)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite on the CPU (accelerator tests skip themselves), in two processes (pytest-xdist;
    a test file's tests stay in one, so its module fixtures are built once); the 20 slowest tests printed."""
    install(session)
    session.run("pytest", "-q", "-n", "2", "--dist", "loadfile", "--durations=20", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the core, the plugins, the tests and the examples."""
    session.install("ruff")
    session.run("ruff", "check", ".", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The offline-inference example end to end."""
    install(session)
    session.run("python", "examples/offline_inference.py", *session.posargs)


@nox.session(venv_params=["--system-site-packages"])
def npu(session: nox.Session) -> None:
    """On an Ascend 950 (CANN, torch-npu and cann_ops_transformer installed in the system Python): the
    plugin's doctor, which runs the conformance suite and the whole-model parity on the NPU and says which
    ops took the primary path and which fell back. The venv reuses the system's torch and torch_npu."""
    session.install("--no-deps", *EDITABLE_PACKAGES)
    session.run("deepinfer-ascend950", "doctor", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """The NVIDIA plugin's tests, conformance included (run on a GPU machine)."""
    install(session)
    session.run("pytest", "-q", "plugins/nvidia_sm100/tests", *session.posargs)


@nox.session
def wheels(session: nox.Session) -> None:
    """The four wheels into dist/, for `pip install --find-links dist "deepinfer[nvidia]"` (see README)."""
    session.install("setuptools>=68")
    for directory in DISTRIBUTIONS:  # setuptools would package files left in build/ by an older tree
        shutil.rmtree(Path(directory) / "build", ignore_errors=True)
    session.run("pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", "dist", *DISTRIBUTIONS)


DOCS_SITE = "mkdocs-material>=9.5,<10"


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml; docs/) built into site/ with `--strict`, so a broken link or
    anchor fails it, then every code block marked runnable in the README and docs/
    (tests/test_docs_examples.py, on the embedded tiny model).

    `-- --no-examples` only builds the site (CI: `nox -s tests` has run the examples already);
    `-- --serve` serves the site locally while you edit."""
    session.install(DOCS_SITE)
    if "--serve" in session.posargs:
        session.run("mkdocs", "serve")
        return
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})
    if "--no-examples" not in session.posargs:
        session.install(TORCH)
        session.install("-e", ".", "-e", "plugins/recipe", "pytest")
        session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs_examples.py")
