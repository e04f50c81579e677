"""The four distributions build as wheels, and `deepinfer[nvidia,ascend,recipe]` installs from them.

Nothing of ours is on PyPI, where `deepinfer` is DeepSeek's own 0.1.0 sdist: our versions stay above it
and the extras pin them, so `pip install --find-links dist "deepinfer[nvidia]"` can only pick ours.

The install test builds a fresh wheelhouse from a copy of the sources and installs it into one fresh
virtual environment offline (`--no-index`), first the bare core, then every extra. That environment sees
this one's third-party packages (torch, pydantic, deepseek-recipe, ...) through a `.pth` file pointing at
a view of its site-packages holding only what the installed distributions declare, their dependencies'
dependencies included: never the test extra (httpx, openai, pytest, ...), so a module importing an
undeclared or optional package at load fails there as it would for a user. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = {"nvidia": "nvidia_sm100", "ascend": "ascend950", "recipe": "recipe"}
"""Extra -> the plugin directory (and entry-point name, but for recipe's)."""
DEEPSEEK_PYPI_VERSION = (0, 1, 0)
"""The version of DeepSeek's own `deepinfer` on PyPI, which ours must stay above."""
STEP_TIMEOUT_S = 150


def _project(directory: Path) -> dict:
    return tomllib.loads((directory / "pyproject.toml").read_text())["project"]


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_versions_agree_and_the_extras_pin_them():
    core = _project(ROOT)
    version = core["version"]
    assert _version_tuple(version) > DEEPSEEK_PYPI_VERSION
    for extra, directory in PLUGINS.items():
        plugin = _project(ROOT / "plugins" / directory)
        assert plugin["version"] == version, plugin["name"]
        assert core["optional-dependencies"][extra] == [f"{plugin['name']}=={version}"]
        # a plugin never accepts DeepSeek's deepinfer 0.1.0 as its core
        (core_requirement,) = [r for r in plugin["dependencies"] if re.match(r"deepinfer\b(?!-)", r)]
        assert core_requirement == "deepinfer>=0.2,<0.3"
    from deepinfer_nvidia_sm100 import __version__

    assert __version__ == version


def test_extras_pull_no_torch_but_the_pinned_one():
    """`[ascend]` adds no torch, CUDA or NVIDIA requirement (torch-npu's torch is the user's); every torch
    requirement of the core and `[nvidia]` accepts the torch the README and noxfile pin."""
    from packaging.requirements import Requirement

    (pinned,) = re.findall(r'^TORCH = "torch==([\d.]+)"', (ROOT / "noxfile.py").read_text(), re.MULTILINE)
    assert f"torch=={pinned}" in (ROOT / "README.md").read_text()
    core = {Requirement(r).name for r in _declared_requirements()}
    added = [Requirement(r) for r in _declared_requirements(("ascend",)) if Requirement(r).name not in core]
    assert added == []
    for requirement in map(Requirement, _declared_requirements(("nvidia",))):
        if requirement.name == "torch":
            assert requirement.specifier.contains(pinned), requirement
        assert not re.match(r"nvidia-|cuda", requirement.name), requirement


def _copy_sources(destination: Path) -> list[Path]:
    """Copies of the four source trees without build outputs (setuptools would package a stale build/)."""
    ignore = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "tests", "benchmarks")
    core = destination / "deepinfer"
    core.mkdir(parents=True)
    shutil.copytree(ROOT / "deepinfer_core", core / "deepinfer_core", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, core / name)
    plugins = [shutil.copytree(ROOT / "plugins" / d, destination / d, ignore=ignore) for d in PLUGINS.values()]
    return [core, *plugins]


def _declared_requirements(extras: tuple[str, ...] = ()) -> list[str]:
    """The third-party requirements `deepinfer[extras]` declares, read from this tree's pyproject files."""
    core = _project(ROOT)
    requirements = list(core["dependencies"])
    for extra in extras:
        requirements += core["optional-dependencies"][extra]
        if extra in PLUGINS:
            requirements += _project(ROOT / "plugins" / PLUGINS[extra])["dependencies"]
    return [r for r in requirements if not re.match(r"deepinfer\b", r)]


def _closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions `requirements` need, their own requirements (markers and extras
    evaluated) included."""
    from packaging.requirements import Requirement

    found: dict[str, importlib.metadata.Distribution] = {}
    pending = [Requirement(r) for r in requirements]
    while pending:
        requirement = pending.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        distribution = importlib.metadata.distribution(requirement.name)
        name = distribution.metadata["Name"].lower().replace("_", "-")
        if name in found:
            continue
        found[name] = distribution
        for text in distribution.requires or []:
            needed = Requirement(text)
            extras = requirement.extras or {""}
            if needed.marker is None or any(needed.marker.evaluate({"extra": extra}) for extra in extras):
                pending.append(needed)
    return list(found.values())


def _add_to_view(view: Path, requirements: list[str]) -> None:
    """Link into `view` the site-packages entries (packages, modules, dist-info) of `requirements`' closure,
    and pip's (the installer, which the fresh environment has none of)."""
    view.mkdir(exist_ok=True)
    distributions = [*_closure(requirements), importlib.metadata.distribution("pip")]
    for distribution in distributions:
        site = Path(distribution.locate_file(""))
        entries = {Path(str(file)).parts[0] for file in distribution.files or [] if ".." not in Path(str(file)).parts}
        for entry in entries - {"__pycache__"}:
            if not (view / entry).exists() and (site / entry).exists():
                (view / entry).symlink_to(site / entry)


def _run(*command: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    env = {**(os.environ if env is None else env), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, check=False,
                            timeout=STEP_TIMEOUT_S, env=env, cwd=cwd)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _deepinfer(environment: Path, *args: str, env: dict[str, str], cwd: Path, returncode: int = 0):
    """Run the installed `deepinfer` command; its exit code must be `returncode`."""
    result = subprocess.run([str(environment / "bin" / "deepinfer"), *args], capture_output=True, text=True,
                            check=False, timeout=STEP_TIMEOUT_S, env=env, cwd=cwd)
    assert result.returncode == returncode, f"deepinfer {args}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.packaging
@pytest.mark.skipif(sys.platform == "win32", reason="the environment view uses symlinks")
def test_extras_install_from_a_fresh_wheelhouse(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheels offline needs setuptools (the test extra)")
    wheelhouse = tmp_path / "wheelhouse"
    sources = _copy_sources(tmp_path / "src")
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", wheelhouse, *sources)
    version = _project(ROOT)["version"]
    wheels = sorted(path.name.split("-")[0] for path in wheelhouse.glob(f"*-{version}-*.whl"))
    assert wheels == ["deepinfer", "deepinfer_ascend950", "deepinfer_nvidia_sm100", "deepinfer_recipe"]

    # no pip or setuptools of its own: the view's (this environment's) serve, so nothing is downloaded
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=False)
    python = environment / "bin" / "python"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("DEEPINFER_", "PYTHON"))}
    env |= {"DEEPINFER_ACCELERATOR": "cpu", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", env=env).strip()
    view = tmp_path / "third_party"
    (Path(site) / "third_party.pth").write_text(f"{view}\n")

    # the bare core: every command answers, those needing an extra with what to install
    _add_to_view(view, _declared_requirements())
    _run(python, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", wheelhouse, "deepinfer",
         env=env, cwd=tmp_path)
    assert "usage: deepinfer" in _deepinfer(environment, "--help", env=env, cwd=tmp_path).stdout
    assert "reference" in _deepinfer(environment, "plugins", env=env, cwd=tmp_path).stdout
    assert "--max-model-len" in _deepinfer(environment, "serve", "--help", env=env, cwd=tmp_path).stdout  # no server needed
    serve = _deepinfer(environment, "serve", env=env, cwd=tmp_path, returncode=2)  # running it needs the server
    assert '--find-links dist "deepinfer[recipe]"' in serve.stderr and "Traceback" not in serve.stderr
    assert "--prefill" in _deepinfer(environment, "router", "--help", env=env, cwd=tmp_path).stdout  # no httpx needed
    router = _deepinfer(environment, "router", "--prefill", "http://p:1", "--decode", "http://d:2", env=env, cwd=tmp_path,
                        returncode=2)
    assert 'pip install --find-links dist "deepinfer[pd]"' in router.stderr

    # every plugin extra (the README's route), into the same environment
    _add_to_view(view, _declared_requirements(tuple(PLUGINS)))
    _run(python, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", wheelhouse,
         f"deepinfer[{','.join(PLUGINS)}]", env=env, cwd=tmp_path)
    installed = sorted(path.name.split("-")[0] for path in Path(site).glob("*.dist-info"))
    assert installed == wheels  # the extras needed nothing but our four distributions beside the view's
    report = _deepinfer(environment, "plugins", env=env, cwd=tmp_path).stdout
    plugin_rows = report.split("backends:")[0].splitlines()
    versions = {row.split()[0]: row.split()[1] for row in plugin_rows[4:] if row.strip()}
    assert versions == {"reference": version, "recipe": version, "nvidia_sm100": version, "ascend950": version}
    modules = ["deepinfer_core", "deepinfer_recipe", "deepinfer_nvidia_sm100", "deepinfer_ascend950"]
    located = _run(python, "-c", f"import importlib; [print(importlib.import_module(m).__file__) for m in {modules}]",
                   env=env, cwd=tmp_path).split()
    assert len(located) == 4 and all(path.startswith(site) for path in located), located
    assert "--max-model-len" in _deepinfer(environment, "serve", "--help", env=env, cwd=tmp_path).stdout
    example = _run(python, ROOT / "examples" / "offline_inference.py", "--max-tokens", "2", env=env, cwd=tmp_path)
    assert example.count("completion: ") == example.count("prompt: ") > 0 and " new tokens in " in example, example
