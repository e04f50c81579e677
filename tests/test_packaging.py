"""The four distributions build as wheels, and `deepinfer[nvidia,ascend,recipe]` installs from them.

Nothing of ours is on PyPI, where `deepinfer` is DeepSeek's own 0.1.0 sdist: our versions stay above it
and the extras pin them, so `pip install --find-links dist "deepinfer[nvidia]"` can only pick ours.

The install test builds a fresh wheelhouse from a copy of the sources and installs it into a fresh
virtual environment offline (`--no-index`). That environment sees this one's third-party packages
(torch, pydantic, deepseek-recipe, ...) through a `.pth` file pointing at a view of its site-packages
without any DeepInfer distribution, so nothing is downloaded and only the new wheels provide DeepInfer.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
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


def _third_party_view(destination: Path) -> Path:
    """A directory of links to this environment's site-packages entries, DeepInfer's left out."""
    destination.mkdir()
    for site in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
        for entry in Path(site).iterdir():
            if "deepinfer" not in entry.name.lower() and not entry.name.endswith(".pth") \
                    and not (destination / entry.name).exists():
                (destination / entry.name).symlink_to(entry)
    return destination


def _run(*command: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    env = {**(os.environ if env is None else env), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, check=False,
                            timeout=STEP_TIMEOUT_S, env=env, cwd=cwd)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


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
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", env=env).strip()
    (Path(site) / "third_party.pth").write_text(f"{_third_party_view(tmp_path / 'third_party')}\n")
    _run(python, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", wheelhouse,
         f"deepinfer[{','.join(PLUGINS)}]", env=env, cwd=tmp_path)

    report = _run(environment / "bin" / "deepinfer", "plugins", env=env, cwd=tmp_path)
    plugin_rows = report.split("backends:")[0].splitlines()
    versions = {row.split()[0]: row.split()[1] for row in plugin_rows[4:] if row.strip()}
    assert versions == {"reference": version, "recipe": version, "nvidia_sm100": version, "ascend950": version}
    modules = ["deepinfer_core", "deepinfer_recipe", "deepinfer_nvidia_sm100", "deepinfer_ascend950"]
    located = _run(python, "-c", f"import importlib; [print(importlib.import_module(m).__file__) for m in {modules}]",
                   env=env, cwd=tmp_path).split()
    assert len(located) == 4 and all(path.startswith(site) for path in located), located
