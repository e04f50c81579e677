from __future__ import annotations

import argparse
import sys

import pytest

from deepinfer_core.config import EngineConfig
from deepinfer_core.entrypoints.limits import DEFAULT_MAX_BODY_BYTES, HttpLimits
from deepinfer_core.entrypoints.serve_cli import add_serve_parser, run_serve
from deepinfer_core.models.tiny import embedded_tiny_model_dir


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deepinfer")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_defaults_serve_the_embedded_model_locally() -> None:
    args = parse(["serve"])
    assert args.model_dir is None and args.host == "127.0.0.1" and args.port == 8000
    assert args.max_body_bytes == DEFAULT_MAX_BODY_BYTES and args.handler is run_serve


def test_names_and_limits() -> None:
    args = parse(["serve", "/ckpt", "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "flash",
                  "--model-alias", "a", "--model-alias", "b", "--max-model-len", "4096", "--enable-prefix-caching"])
    assert (args.model_dir, args.host, args.port) == ("/ckpt", "0.0.0.0", 9000)
    assert args.served_model_name == "flash" and args.model_alias == ["a", "b"]
    assert args.max_model_len == 4096 and args.enable_prefix_caching


def test_engine_options_reach_the_engine_config() -> None:
    from deepinfer_core.entrypoints.serve_cli import engine_config_of

    args = parse(["serve", "--dtype", "float16", "--max-model-len", "4096", "--max-num-seqs", "8",
                  "--max-num-batched-tokens", "1024", "--gpu-memory-utilization", "0.5", "--enforce-eager",
                  "--cuda-graph-sizes", "1", "8"])
    model_dir = str(embedded_tiny_model_dir())
    config = engine_config_of(args, model_dir)
    assert (config.dtype, config.max_model_len, config.max_num_seqs) == ("float16", 4096, 8)
    assert config.max_num_batched_tokens == 1024 and config.gpu_memory_utilization == 0.5 and config.enforce_eager
    assert config.cuda_graph_sizes == (1, 8)
    engram = engine_config_of(parse(["serve", "--engram-placement", "host", "--no-engram-prefetch"]), model_dir)
    assert (engram.engram_placement, engram.engram_prefetch) == ("host", False)
    assert engine_config_of(parse(["serve", "--decoder-trimming"]), model_dir).decoder_trimming is True
    defaults = engine_config_of(parse(["serve"]), model_dir)
    assert defaults == EngineConfig(model=model_dir)  # unset options keep the engine's defaults


def test_http_limits_and_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer_core.entrypoints.serve_cli import http_limits_of

    args = parse(["serve", "--body-read-timeout", "5", "--limit-concurrency", "64", "--timeout-keep-alive", "2",
                  "--api-key", "k1"])
    assert http_limits_of(args) == HttpLimits(body_read_timeout_s=5, limit_concurrency=64, timeout_keep_alive_s=2)
    assert args.api_key == "k1"
    assert parse(["serve"]).api_key is None
    monkeypatch.setenv("DEEPINFER_API_KEY", "from-env")
    assert parse(["serve"]).api_key == "from-env"
    assert parse(["serve", "--api-key", "flag-wins"]).api_key == "flag-wins"


def test_without_the_serving_extra_any_options_get_the_install_hint(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    from deepinfer_core import cli

    for name in ("deepinfer_core.entrypoints.serve", "deepinfer_core.entrypoints.serve_cli"):
        monkeypatch.setitem(sys.modules, name, None)  # as if fastapi were missing
    assert cli.main(["serve", "--port", "8000", "/ckpt", "--max-model-len", "4"]) == 2
    # the README's route: our wheels are not on PyPI, where `deepinfer` is another project
    assert 'pip install --find-links dist "deepinfer[recipe]"' in capsys.readouterr().err


def test_without_the_recipe_plugin_serve_says_what_to_install_before_loading(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from deepinfer_core import cli, plugins
    from deepinfer_core.engine import engine

    monkeypatch.setattr(plugins, "chat_encodings", dict)  # no plugin registers a chat encoding
    monkeypatch.setattr(engine, "Engine", lambda *a, **k: pytest.fail("the engine was built"))
    assert cli.main(["serve", "--port", "8000"]) == 1
    assert 'pip install "deepinfer[recipe]"' in capsys.readouterr().err


def test_prefix_tier_options_reach_the_engine_config(tmp_path) -> None:
    from deepinfer_core.entrypoints.serve_cli import engine_config_of

    args = parse(["serve", "--enable-prefix-caching", "--host-cache-gib", "2", "--prefix-store-path", str(tmp_path),
                  "--prefix-store-gib", "100", "--prefix-store-ttl", "agent=60", "--prefix-store-ttl", "chat=120",
                  "--default-traffic-class", "agent"])
    config = engine_config_of(args, str(embedded_tiny_model_dir()))
    assert (config.host_cache_gib, config.prefix_store_path, config.prefix_store_gib) == (2.0, str(tmp_path), 100.0)
    assert config.prefix_store_ttl_s == {"agent": 60.0, "chat": 120.0} and config.default_traffic_class == "agent"
    with pytest.raises(ValueError, match="TTL > 0"):
        engine_config_of(parse(["serve", "--enable-prefix-caching", "--prefix-store-path", str(tmp_path),
                                "--prefix-store-ttl", "agent"]), str(embedded_tiny_model_dir()))
