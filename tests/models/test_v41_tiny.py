"""The embedded tiny V4.1 model: the example picks it with --family v41 (or DEEPINFER_MODEL_FAMILY=v41)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core.models.tiny import embedded_model_dir

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_runs_the_embedded_v41_model(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "DEEPINFER_MODEL_FAMILY": "v41", "OMP_NUM_THREADS": "1"}
    env.pop("DEEPINFER_HF_MODEL_DIR", None)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "offline_inference.py"), "--max-tokens", "2",
                             "--num-prompts", "1", "--dtype", "float32"], check=False, env=env, capture_output=True,
                            text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tiny random DeepSeek-V4.1 model" in result.stdout and "1 prompts, 2 new tokens" in result.stdout
    assert list(tmp_path.glob("deepinfer/tiny-v41-*/model.safetensors"))


def test_an_unknown_family_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        embedded_model_dir("v5")
