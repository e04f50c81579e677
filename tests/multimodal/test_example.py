"""examples/image_input.py runs on the embedded tiny V4.1 model with a vision tower: an image through
`LLM.generate` and `LLM.chat`, the second read from the encoder cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("PIL.Image")
pytest.importorskip("deepinfer_recipe", reason="LLM.chat needs the recipe plugin")

ROOT = Path(__file__).resolve().parents[2]


def test_the_image_example_runs(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("DEEPINFER_HF_MODEL_DIR", None)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "image_input.py"), "--max-tokens", "1"],
                            check=False, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("generate: ") for line in lines) and any(line.startswith("chat: ") for line in lines)
    assert "1 image(s) encoded" in result.stdout and "1 encoder-cache hit(s)" in result.stdout
