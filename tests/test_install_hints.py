"""Every install hint the tool prints or the docs give names a target that installs ours (issue 49 item 5).

`deepinfer` on PyPI is another project and our plugins are not there, so a hint names our distributions
only with `--find-links dist` (the wheels `nox -s wheels` builds) or as an editable source directory; an
extra it names is one that directory's pyproject.toml declares; any other package it names is a
requirement one of our pyproject files declares.
"""

from __future__ import annotations

import ast
import itertools
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from deepinfer_core import cli, plugins

ROOT = Path(__file__).resolve().parents[1]
PROJECTS = {path.parent: tomllib.loads(path.read_text())["project"]
            for path in [ROOT / "pyproject.toml", *sorted((ROOT / "plugins").glob("*/pyproject.toml"))]}
OURS = {project["name"]: directory for directory, project in PROJECTS.items()}
DECLARED = {re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower()
            for project in PROJECTS.values()
            for requirement in [*project.get("dependencies", []),
                                *(r for extra in project.get("optional-dependencies", {}).values() for r in extra)]}
RUNNERS = {"nox"}
"""Tools the README installs to run the project's sessions, not requirements of it."""
REQUIREMENT = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(\[(?P<extras>[^\]]*)\])?(?P<spec>[<>=!~].*)?$")
PIP_INSTALL = re.compile(r"pip install ([^`#(),;&\n]*)")
"""A command's arguments: up to the end of its code span, a comment, an aside or the next command."""


def extras_of(directory: Path) -> set[str]:
    return set(PROJECTS[directory].get("optional-dependencies", {}))


def problems(command: str) -> list[str]:
    """What is wrong with one `pip install ARGS` (empty: every target installs ours or what we declare)."""
    words = shlex.split(command)
    found_links = any(w == "--find-links" and nxt == "dist" for w, nxt in itertools.pairwise(words))
    wrong, editable, skip = [], False, False
    for word in words:
        if skip:
            skip = False
            continue
        if word in ("--find-links", "-f"):
            skip = True
            continue
        if word in ("-e", "--editable"):
            editable = True
            continue
        if word.startswith("-"):
            continue
        if editable:  # a source directory, with extras it declares
            editable = False
            path, _, extras = word.partition("[")
            directory = (ROOT / path).resolve()
            if directory not in PROJECTS:
                wrong.append(f"{word}: no pyproject.toml of ours in {path}")
            elif not set(filter(None, extras.rstrip("]").split(","))) <= extras_of(directory):
                wrong.append(f"{word}: {path} declares the extras {sorted(extras_of(directory))}")
            continue
        match = REQUIREMENT.match(word)
        if match is None:
            wrong.append(f"{word}: not a requirement")
            continue
        name, extras = match["name"].lower(), set(filter(None, (match["extras"] or "").split(",")))
        if name in OURS:
            if not found_links:
                wrong.append(f"{word}: ours is not on PyPI; name it with --find-links dist or -e")
            if not extras <= extras_of(OURS[name]):
                wrong.append(f"{word}: {name} declares the extras {sorted(extras_of(OURS[name]))}")
        elif name not in DECLARED | RUNNERS:
            wrong.append(f"{word}: no pyproject of ours declares {name}")
    return wrong


def hints_in_source() -> list[tuple[str, str]]:
    """Every plain string in the core, the plugins and the benches that holds a `pip install` command."""
    files = [*ROOT.glob("deepinfer_core/**/*.py"), *ROOT.glob("plugins/*/src/**/*.py"), *ROOT.glob("bench/*.py")]
    hints = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        formatted = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
        hints += [(f"{path.relative_to(ROOT)}:{node.lineno}", node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in formatted
                  and "pip install" in node.value]
    return hints


def hints_in_docs() -> list[tuple[str, str]]:
    pages = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("plugins/*/README.md")]
    return [(f"{page.relative_to(ROOT)}:{number}", line) for page in pages
            for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1) if "pip install" in line]


def printed_hints() -> list[tuple[str, str]]:
    """The hints the tool composes at run time: one per extra, and those it prints for missing modules."""
    from deepinfer_core.entrypoints.chat import RECIPE_HINT
    from deepinfer_core.kv.nixl_transfer import NIXL_HINT

    extras = sorted(extras_of(ROOT))
    return ([(f"install_hint({extra!r})", plugins.install_hint(extra)) for extra in extras]
            + [("RECIPE_HINT", RECIPE_HINT), ("NIXL_HINT", NIXL_HINT)]
            + [(f"cli: {module} missing", plugins.install_hint(extra)) for module, extra in cli.EXTRA_OF_MODULE.items()])


@pytest.mark.parametrize("source", [printed_hints, hints_in_source, hints_in_docs])
def test_every_install_hint_names_an_installable_target(source) -> None:
    hints = source()
    assert hints, f"{source.__name__} found no hint: the scan is broken"
    wrong = [f"{where}: {problem}" for where, text in hints
             for command in PIP_INSTALL.findall(text) for problem in problems(command)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("command", "is_right"), [
    ('"deepinfer[recipe]"', False),  # PyPI's `deepinfer` is another project
    ('--find-links dist "deepinfer[recipe]"', True),
    ('--find-links dist "deepinfer[serving]"', False),  # no such extra
    ("-e plugins/recipe", True),
    ("-e plugins/nothing", False),
    ('-e ".[pd]"', True),
    ("'deepinfer-nvidia-sm100[triton]'", False),  # our plugin, not on PyPI
    ('"triton>=3.2"', True),  # the nvidia plugin's triton extra declares it
    ("left-pad", False),
])
def test_the_checker_tells_right_from_wrong(command: str, is_right: bool) -> None:
    assert (not problems(command)) is is_right, problems(command)


def test_the_printed_hint_of_a_missing_extra_runs_from_a_checkout() -> None:
    """The source-checkout half of each hint names a directory that holds the extra."""
    assert sys.modules["deepinfer_core"].__file__.startswith(str(ROOT))
    for extra in extras_of(ROOT):
        hint = plugins.install_hint(extra)
        assert "--find-links dist" in hint and "pip install -e" in hint, hint
