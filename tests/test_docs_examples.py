"""The documentation's runnable code blocks run, and the README's links lead somewhere.

A fenced ```python block on the line after `<!-- runnable -->` in README.md or a page under docs/ is
runnable (docs/development.md says what such a block may do). Every runnable block of every page runs in
one Python process started from the repository root (so this tree's `deepinfer_core` is imported), each
block in a fresh namespace; a page's test fails with the block's line and its error. `nox -s docs` runs
this file after building the site; it also runs with the test suite. Not to be confused with
tests/entrypoints/test_docs.py, which checks the Serving page's client snippets.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
TIMEOUT_S = 600

# Runs in the child: reads [[page, line, code], ...] on stdin, answers {"page:line": error or null} on stdout.
_RUNNER = r"""
import gc, json, sys, traceback
blocks = json.load(sys.stdin)
results = {}
for page, line, code in blocks:
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, f"{page}:{line}", "exec"), namespace)
        results[f"{page}:{line}"] = None
    except BaseException:
        results[f"{page}:{line}"] = traceback.format_exc(limit=-3)
    del namespace
    gc.collect()
sys.stdout.write("\n" + json.dumps(results))
"""


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) of every runnable block of a markdown text.

    :raises ValueError: a marker not followed by a ```python block on the next line.
    """
    lines, blocks = text.splitlines(), []
    for index, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        if index + 1 >= len(lines) or lines[index + 1].strip() != "```python":
            raise ValueError(f"line {index + 1}: {MARKER} must be followed by a ```python block")
        end = next((j for j in range(index + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"line {index + 2}: the runnable block is never closed")
        blocks.append((index + 3, "\n".join(lines[index + 2:end]) + "\n"))
    return blocks


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.fixture(scope="module")
def results() -> dict[str, str | None]:
    """Every page's runnable blocks, run in one child process (one torch import for all of them)."""
    blocks = [[_name(page), line, code] for page in PAGES
              for line, code in runnable_blocks(page.read_text(encoding="utf-8"))]
    done = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(blocks), capture_output=True,
                          text=True, cwd=ROOT, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, f"the runner itself failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.rsplit("\n", 1)[-1])


def test_the_marker_finds_blocks_and_refuses_a_misplaced_one() -> None:
    page = f"text\n\n{MARKER}\n```python\nx = 1\nprint(x)\n```\n\n```python\nnot_run()\n```\n"
    assert runnable_blocks(page) == [(5, "x = 1\nprint(x)\n")]
    with pytest.raises(ValueError, match="must be followed by"):
        runnable_blocks(f"{MARKER}\n\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        runnable_blocks(f"{MARKER}\n```python\nx = 1\n")


def test_the_pages_that_promise_runnable_examples_have_them() -> None:
    with_blocks = {_name(page) for page in PAGES if runnable_blocks(page.read_text(encoding="utf-8"))}
    assert {"README.md", "docs/offline.md", "docs/real-checkpoint.md", "docs/precision.md",
            "docs/speculative.md", "docs/structured-output.md"} <= with_blocks


@pytest.mark.parametrize("page", [p for p in PAGES if runnable_blocks(p.read_text(encoding="utf-8"))], ids=_name)
def test_runnable_blocks_run(page: Path, results: dict[str, str | None]) -> None:
    failures = {key: error for key, error in results.items() if key.startswith(f"{_name(page)}:") and error}
    assert not failures, "\n".join(f"{key}:\n{error}" for key, error in failures.items())
    assert any(key.startswith(f"{_name(page)}:") for key in results)


def test_readme_links_lead_to_files() -> None:
    # the README is not part of the site, so `mkdocs build --strict` does not check its links
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme) if "://" not in t]
    assert targets
    assert [t for t in targets if not (ROOT / t).exists()] == []
