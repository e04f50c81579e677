"""examples/image_input.py runs on the embedded tiny V4.1 model with a vision tower: an image through
`LLM.generate` and `LLM.chat`, the second read from the encoder cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.inprocess import run_path

pytest.importorskip("PIL.Image")
pytest.importorskip("deepinfer_recipe", reason="LLM.chat needs the recipe plugin")

ROOT = Path(__file__).resolve().parents[2]


def test_the_image_example_runs(tmp_path, monkeypatch):
    # in this process (tests/bench/inprocess.py: run as __main__, stdout captured), with a fresh user cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    out = run_path(ROOT / "examples" / "image_input.py", "--max-tokens", "1")
    lines = out.splitlines()
    assert any(line.startswith("generate: ") for line in lines) and any(line.startswith("chat: ") for line in lines)
    assert "1 image(s) encoded" in out and "1 encoder-cache hit(s)" in out
