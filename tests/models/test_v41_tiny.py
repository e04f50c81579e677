"""The embedded tiny V4.1 model: the example picks it with --family v41 (or DEEPINFER_MODEL_FAMILY=v41)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_core.models.tiny import embedded_model_dir
from tests.bench.inprocess import run_path

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_runs_the_embedded_v41_model(tmp_path, monkeypatch):
    # in this process (tests/bench/inprocess.py: run as __main__, stdout captured), with a fresh user cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("DEEPINFER_MODEL_FAMILY", "v41")
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    out = run_path(ROOT / "examples" / "offline_inference.py", "--max-tokens", "2", "--num-prompts", "1",
                   "--dtype", "float32")
    assert "tiny random DeepSeek-V4.1 model" in out and "1 prompts, 2 new tokens" in out
    assert list(tmp_path.glob("deepinfer/tiny-v41-*/model.safetensors"))


def test_an_unknown_family_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        embedded_model_dir("v5")
