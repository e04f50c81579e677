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
    assert 'pip install --find-links dist "deepinfer[recipe]"' in capsys.readouterr().err


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


def test_every_engine_config_field_is_a_documented_flag() -> None:
    from deepinfer_core.entrypoints.engine_flags import NOT_FLAGS

    parser = argparse.ArgumentParser(prog="deepinfer")
    serve = add_serve_parser(parser.add_subparsers(dest="command"))
    actions = {action.dest: action for action in serve._actions}
    for name, field in EngineConfig.model_fields.items():
        assert field.description, f"EngineConfig.{name} has no description (its --help text)"
        if name in NOT_FLAGS:
            continue
        assert name in actions, f"EngineConfig.{name} has no deepinfer serve option"
        assert actions[name].help.startswith(field.description.replace("%", "%%")), name
        assert actions[name].default is None, f"--{name}: unset options must keep EngineConfig's default"


def test_every_llm_keyword_is_a_flag() -> None:
    import inspect

    from deepinfer_core import LLM

    serve = parse(["serve"])
    # decode_sequence shapes LLM.generate's return value; expert_parallel_size is DeepInfer 0.1's spelling
    # (only 1; vLLM's --enable-expert-parallel is the option)
    offline_only = {"self", "model", "engine_options", "decode_sequence", "expert_parallel_size"}
    keywords = set(inspect.signature(LLM.__init__).parameters) - offline_only
    assert keywords and all(hasattr(serve, name) for name in keywords), sorted(keywords - set(vars(serve)))


def test_vllm_model_spelling_and_no_abbreviations(capsys: pytest.CaptureFixture) -> None:
    from deepinfer_core.entrypoints.serve_cli import checkpoint_of

    args = parse(["serve", "--model", "/ckpt", "--model-alias", "a"])
    assert checkpoint_of(args) == "/ckpt" and args.model_alias == ["a"]
    assert checkpoint_of(parse(["serve", "/ckpt"])) == "/ckpt" and checkpoint_of(parse(["serve"])) is None
    with pytest.raises(ValueError, match="two checkpoints"):
        checkpoint_of(parse(["serve", "/a", "--model", "/b"]))
    for abbreviated in (["--max-model", "4"], ["--model-a", "x"], ["--enable-prefix"]):
        with pytest.raises(SystemExit):
            parse(["serve", *abbreviated])
        assert "unrecognized arguments" in capsys.readouterr().err


def test_dtype_takes_vllm_spellings(capsys: pytest.CaptureFixture) -> None:
    assert parse(["serve", "--dtype", "half"]).dtype == "float16"
    assert parse(["serve", "--dtype", "bf16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parse(["serve", "--dtype", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_generated_flags_reach_the_engine_config() -> None:
    from deepinfer_core.entrypoints.serve_cli import engine_config_of

    args = parse(["serve", "--seed", "7", "--quantized-weights", "dequantize", "--swa-replay", "exact",
                  "--no-async-scheduling", "--num-kv-blocks", "64", "--eplb-config", '{"window_size": 10}',
                  "-tp", "1", "--role", "decode"])
    config = engine_config_of(args, str(embedded_tiny_model_dir()))
    assert (config.seed, config.quantized_weights, config.swa_replay, config.num_kv_blocks) == (
        7, "dequantize", "exact", 64)
    assert config.async_scheduling is False and config.eplb_config.window_size == 10
    assert config.kv_transfer_role == "decode" and config.enable_prefix_caching  # the role implies the cache


def test_unimplemented_vllm_options_say_so() -> None:
    from deepinfer_core import LLM
    from deepinfer_core.entrypoints.serve_cli import engine_config_of

    model_dir = str(embedded_tiny_model_dir())
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size"):
        engine_config_of(parse(["serve", "-pp", "2"]), model_dir)
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size"):
        LLM(model_dir, pipeline_parallel_size=2)
    with pytest.raises(NotImplementedError, match="tokenizer"):
        engine_config_of(parse(["serve", "--tokenizer", "/elsewhere"]), model_dir)
    with pytest.raises(NotImplementedError, match="chat-template"):
        engine_config_of(parse(["serve", "--chat-template", "t.jinja"]), model_dir)
    assert engine_config_of(parse(["serve", "--tokenizer", model_dir, "--trust-remote-code"]), model_dir)


def test_cors_answers_browsers_only_when_origins_are_allowed() -> None:
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from deepinfer_core.entrypoints.auth import ApiKeyMiddleware
    from deepinfer_core.entrypoints.serve_cli import add_cors

    def app_for(argv: list[str]) -> FastAPI:
        app = FastAPI()
        app.get("/v1/models")(lambda: {"data": []})
        app.add_middleware(ApiKeyMiddleware, api_key="k")
        add_cors(app, parse(["serve", *argv]))
        return app

    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "GET",
                 "Access-Control-Request-Headers": "authorization"}
    allowed = TestClient(app_for(["--allowed-origins", '["https://app.example"]'])).options("/v1/models",
                                                                                          headers=preflight)
    assert allowed.status_code == 200  # answered before the API key is asked for
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    refused = TestClient(app_for([])).get("/v1/models", headers={"Origin": "https://app.example",
                                                                "Authorization": "Bearer k"})
    assert refused.status_code == 200 and "access-control-allow-origin" not in refused.headers
    with pytest.raises(SystemExit):
        parse(["serve", "--allowed-origins", "*"])  # vLLM's shape is a JSON list


def test_tls_and_log_level_reach_uvicorn() -> None:
    from deepinfer_core.entrypoints.serve_cli import uvicorn_options_of

    options = uvicorn_options_of(parse(["serve", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
                                        "--uvicorn-log-level", "warning"]))
    assert (options["ssl_keyfile"], options["ssl_certfile"], options["log_level"]) == ("k.pem", "c.pem", "warning")
    assert options["limit_concurrency"] == HttpLimits().limit_concurrency
    with pytest.raises(ValueError, match="both --ssl-keyfile and --ssl-certfile"):
        uvicorn_options_of(parse(["serve", "--ssl-keyfile", "k.pem"]))


@pytest.mark.parametrize("model", ["deepseek-ai/DeepSeek-V4-Flash", "/no/such/checkpoint"])
def test_a_hub_id_or_a_wrong_path_is_one_plain_sentence(model: str, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    from deepinfer_core import LLM, cli
    from deepinfer_core.config import CheckpointError

    monkeypatch.chdir("/")
    assert cli.main(["serve", "--model", model]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("deepinfer serve: error: ")
    assert "validation error" not in err and "http" not in err and "type=" not in err
    assert ("hub id" in err) == (not model.startswith("/"))
    with pytest.raises(CheckpointError) as info:
        LLM(model)
    assert "\n" not in str(info.value) and "validation" not in str(info.value)


def test_serving_the_tiny_model_is_announced_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    from deepinfer_core import cli, plugins

    monkeypatch.setattr(plugins, "chat_encodings", dict)  # stop before the engine is built
    assert cli.main(["serve"]) == 1
    announcement, *rest = capsys.readouterr().err.splitlines()
    assert "embedded tiny DeepSeek-V4 model" in announcement and "random weights" in announcement
    assert str(embedded_tiny_model_dir()) in announcement and "XDG_CACHE_HOME" in announcement
    assert len(rest) == 1 and "recipe" in rest[0]


def test_a_pd_role_without_nixl_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from deepinfer_core import cli
    from deepinfer_core.engine import engine

    for name in ("nixl", "nixl_cu13"):
        monkeypatch.setitem(sys.modules, name, None)  # as if NIXL were not installed
    monkeypatch.setattr(engine, "Engine", lambda *a, **k: pytest.fail("the engine was built"))
    assert cli.main(["serve", str(embedded_tiny_model_dir()), "--role", "prefill"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install --find-links dist "deepinfer[pd]"' in err and "--role prefill" in err
