"""The Serving docs (docs/serving.md, once the README's Serving section): the client snippets and the load
bench's requirements."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def serving_section() -> str:
    return (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")


def test_readme_client_snippets_bound_the_answer() -> None:
    snippets = re.findall(r"```python\n(.*?)```", serving_section(), flags=re.DOTALL)
    creates = [call for snippet in snippets for call in re.findall(r"\.create\((.*?)\n\)", snippet, flags=re.DOTALL)]
    assert creates, "the Serving section shows a client call"
    for call in creates:
        assert "max_tokens=" in call, call  # without it the answer may run to the end of the context


def test_readme_documents_the_api_key_variable() -> None:
    from deepinfer_core.entrypoints.auth import API_KEY_ENV

    assert API_KEY_ENV in serving_section() and "--api-key" in serving_section()


def test_serve_load_says_what_to_install() -> None:
    hide_httpx = ("import runpy, sys; sys.modules['httpx'] = None; sys.argv = ['serve_load.py']; "
                  "runpy.run_path('bench/serve_load.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", hide_httpx], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "pip install httpx" in done.stderr and "Traceback" not in done.stderr


def test_readme_table_names_every_field_the_server_reads_or_refuses() -> None:
    """Issue 49 items 4 and 8: where the server differs from vLLM, the README's table says so."""
    from deepinfer_core.entrypoints.request_fields import GUIDED_FIELDS, REFUSED_FIELDS, SAMPLING_FIELDS

    section = serving_section()
    table = section[section.index("Where the server differs from vLLM"):]
    table = table[:table.index("```")]
    for name in (*SAMPLING_FIELDS, *GUIDED_FIELDS, *REFUSED_FIELDS, "structured_outputs", "max_completion_tokens"):
        assert f"`{name}`" in table, name
