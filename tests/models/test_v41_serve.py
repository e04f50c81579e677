"""`deepinfer serve` on a V4.1 checkpoint: the recipe's V4.1 encoding, answering to DeepSeek-V4.1-Flash."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("deepinfer_recipe", reason="the HTTP server needs the recipe plugin")

from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import require_chat_encoding, running_server
from tests.models.v41_helpers import make_engine, tiny_checkpoint


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_the_server_answers_chats_as_deepseek_v41_flash(tmp_path_factory):
    directory, weights = tiny_checkpoint(tmp_path_factory)
    require_chat_encoding(str(directory))  # the V4.1 config is read through the registry
    app = build_app(make_engine(directory, weights, max_num_seqs=2, num_kv_blocks=8))
    with running_server(app) as base_url:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=60) as response:
            models = [m["id"] for m in json.loads(response.read())["data"]]
        assert models[0] == "DeepSeek-V4.1-Flash"
        answer = post(f"{base_url}/v1/chat/completions", {
            "model": "DeepSeek-V4.1-Flash", "max_tokens": 3,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]})
    assert answer["model"] == "DeepSeek-V4.1-Flash" and answer["usage"]["completion_tokens"] <= 3
    assert answer["choices"][0]["message"]["role"] == "assistant"


def test_the_plugin_listing_reads_a_v41_checkpoint(tmp_path_factory):
    import torch

    from deepinfer_core.cli import representative_specs
    from deepinfer_core.models.deepseek_v41.config import V41Config

    directory, _ = tiny_checkpoint(tmp_path_factory)
    specs = representative_specs(V41Config.from_dir(directory), torch.float32)
    assert sorted({spec.compress_rate for spec in specs["make_attention"]}) == [0, 1, 2]
    assert specs["make_verifier"][0].max_draft_tokens == 1
