"""The `deepinfer serve` command: its options (vLLM's names for the engine's), and uvicorn.

    deepinfer serve /path/to/checkpoint --port 8000 --max-model-len 65536 --api-key "$KEY"
    deepinfer serve --model /path/to/checkpoint ...      # vLLM's other spelling

The engine options are generated from `EngineConfig`'s fields (`engine_flags`). Parsing imports neither
torch nor the engine (`deepinfer serve --help` answers at once); `run_serve` does.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from deepinfer_core.entrypoints.engine_flags import add_engine_arguments, check_vllm_options, engine_options
from deepinfer_core.entrypoints.http_options import (
    API_KEY_ENV,
    PD_SECRET_ENV,
    HttpLimits,
    add_http_limit_arguments,
    http_limits_from,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to `deepinfer`'s argument parser."""
    parser = subparsers.add_parser("serve", help="serve a checkpoint over HTTP (OpenAI and Anthropic APIs)",
                                   description="Serve a checkpoint over HTTP: OpenAI Chat Completions, Responses "
                                               "and Completions, Anthropic Messages.", allow_abbrev=False)
    parser.add_argument("model_dir", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint directory; omitted (and no --model), the embedded tiny model is served")
    parser.add_argument("--model", default=None, metavar="MODEL", help="checkpoint directory (vLLM's spelling)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name responses report (default: the family's official name)")
    parser.add_argument("--model-alias", action="append", default=[], help="another accepted model name")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"key every /v1 request must present (Bearer, or x-api-key for Anthropic's API); "
                             f"default: ${API_KEY_ENV}, else none")
    parser.add_argument("--public-url", default=None,
                        help="this server's base URL as other instances reach it (default http://HOST:PORT)")
    parser.add_argument("--prefill-url", action="append", default=[],
                        help="a decode instance's prefill instance (its --public-url), the only sources it reads KV "
                             f"from (repeatable); the router and instances share ${PD_SECRET_ENV}, else --api-key")
    parser.add_argument("--chat-template", default=None,
                        help="vLLM's custom chat template: not implemented; chats are encoded the model family's "
                             "official way (the recipe plugin)")
    add_engine_arguments(parser)
    add_http_arguments(parser)
    parser.set_defaults(handler=run_serve)
    return parser


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's limits, CORS, TLS and logging (uvicorn's)."""
    add_http_limit_arguments(parser)  # the limits, shared with `deepinfer router`
    http = parser.add_argument_group("HTTP server")
    http.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
                      help="uvicorn's log level (default info)")
    http.add_argument("--allowed-origins", type=json_list, default=None, metavar="JSON",
                      help='CORS: origins browsers may call from, e.g. \'["https://app.example"]\' or \'["*"]\' '
                           "(default: no CORS headers, so browsers refuse other origins; vLLM allows every origin)")
    http.add_argument("--allowed-methods", type=json_list, default=["*"], metavar="JSON",
                      help='CORS: allowed methods (default ["*"]; with --allowed-origins)')
    http.add_argument("--allowed-headers", type=json_list, default=["*"], metavar="JSON",
                      help='CORS: allowed request headers (default ["*"]; with --allowed-origins)')
    http.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    http.add_argument("--ssl-keyfile", default=None, help="TLS private key file (with --ssl-certfile: serve HTTPS)")
    http.add_argument("--ssl-certfile", default=None, help="TLS certificate file")


def json_list(text: str) -> list[str]:
    """A JSON list of strings option (`--allowed-origins '["*"]'`)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings (e.g. \'["*"]\'), got {text!r}')
    return value


def checkpoint_of(args: argparse.Namespace) -> str | None:
    """The checkpoint asked for: `deepinfer serve MODEL` or `--model MODEL` (None: neither).

    :raises ValueError: when both are given and differ.
    """
    positional, option = args.model_dir, getattr(args, "model", None)
    if positional and option and positional != option:
        raise ValueError(f"two checkpoints given ({positional!r} and --model {option!r}): give one")
    return option or positional


def engine_config_of(args: argparse.Namespace, model_dir: str) -> Any:
    """The `EngineConfig` the parsed options ask for (options left unset keep its defaults).

    :raises NotImplementedError: for a vLLM option accepted by name but not implemented (`--tokenizer`
        elsewhere, `--pipeline-parallel-size` > 1, `--chat-template`).
    """
    from deepinfer_core.config import EngineConfig

    if getattr(args, "chat_template", None) is not None:
        raise NotImplementedError("--chat-template (a custom chat template): chats are encoded the model family's "
                                  "official way, by the recipe plugin")
    if hasattr(args, "pipeline_parallel_size"):
        check_vllm_options(model_dir, args.tokenizer, pipeline_parallel_size=args.pipeline_parallel_size)
    chosen = engine_options(args)
    if chosen.get("kv_transfer_role") is not None:
        chosen["enable_prefix_caching"] = True
        if chosen["kv_transfer_role"] == "prefill":
            chosen.setdefault("host_cache_gib", 1.0)
    return EngineConfig(model=model_dir, **chosen)


def http_limits_of(args: argparse.Namespace) -> HttpLimits:
    """The HTTP limits the parsed options ask for."""
    return http_limits_from(args)


def uvicorn_options_of(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's keyword arguments for the parsed options: limits, TLS, log level.

    :raises ValueError: for only one of `--ssl-keyfile` and `--ssl-certfile`.
    """
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    return {**http_limits_of(args).uvicorn_options(), "log_level": args.uvicorn_log_level,
            "ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile}


def add_cors(app: FastAPI, args: argparse.Namespace) -> None:
    """Answer browsers' cross-origin requests from `--allowed-origins` (none given: no CORS headers).

    Added last, so it is the outermost layer: a preflight is answered before the API key is asked for.
    """
    if args.allowed_origins is None:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                       allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)


@contextmanager
def running_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                   limits: HttpLimits | None = None) -> Iterator[str]:
    """Serve `app` with uvicorn on a background thread (port 0 picks a free one); yields the base URL."""
    import uvicorn

    options = (limits or app.state.server.limits).uvicorn_options()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", **options))
    thread = threading.Thread(target=server.run, name="deepinfer-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")
        time.sleep(0.02)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(30)


def require_chat_encoding(model_dir: str) -> None:
    """Fail before the weights load when no installed plugin encodes this checkpoint's chats.

    :raises ChatEncodingUnavailableError: with the install hint (the recipe plugin is missing).
    """
    from deepinfer_core import plugins
    from deepinfer_core.entrypoints.chat import RECIPE_HINT, ChatEncodingUnavailableError
    from deepinfer_core.models import registry

    model_type = registry.load_model_config(model_dir).model_type
    if model_type not in plugins.chat_encodings():
        raise ChatEncodingUnavailableError(f"no installed plugin serves chats of model_type {model_type!r}; "
                                           f"{RECIPE_HINT}")


def run_serve(args: argparse.Namespace) -> int:
    """Build the engine for the checkpoint asked for (else the embedded tiny model) and serve it until
    interrupted. Problems found before the weights load are one line on stderr and exit code 1."""
    import uvicorn

    from deepinfer_core.engine.data_parallel import build_engine
    from deepinfer_core.entrypoints.serve import build_app

    model_dir = checkpoint_of(args)
    if model_dir is None:
        model_dir = str(announce_tiny_model())
    else:
        from deepinfer_core.models.loading.checkpoint_files import require_checkpoint_dir

        require_checkpoint_dir(model_dir)
    config = engine_config_of(args, model_dir)
    if config.kv_transfer_role is not None and not has_nixl():
        from deepinfer_core.kv.nixl_transfer import NIXL_HINT

        print(f"deepinfer serve: error: --role {config.kv_transfer_role}: {NIXL_HINT}", file=sys.stderr)
        return 1
    require_chat_encoding(model_dir)
    from deepinfer_core.models import registry
    from deepinfer_core.models.loading.weight_formats import check_quantization

    check_quantization(args.quantization, registry.load_model_config(model_dir))
    if config.kv_transfer_role is not None and not (os.environ.get(PD_SECRET_ENV) or args.api_key):
        from deepinfer_core.entrypoints.pd import NO_KEY_HINT

        raise ValueError(NO_KEY_HINT)  # before the weights load
    options = uvicorn_options_of(args)
    app = build_app(build_engine(config), served_model_name=args.served_model_name,
                    model_aliases=args.model_alias, limits=http_limits_of(args), api_key=args.api_key,
                    public_url=args.public_url or f"http://{args.host}:{args.port}",
                    pd_secret=os.environ.get(PD_SECRET_ENV) or None, prefill_urls=args.prefill_url)
    add_cors(app, args)
    uvicorn.run(app, host=args.host, port=args.port, **options)
    return 0


def announce_tiny_model():
    """The embedded tiny model's directory, built on first use, after one line saying it is what is served."""
    from deepinfer_core.models.tiny import embedded_tiny_model_dir

    model_dir = embedded_tiny_model_dir()
    print(f"deepinfer serve: no checkpoint given (deepinfer serve MODEL): serving the embedded tiny DeepSeek-V4 "
          f"model, random weights (its answers are gibberish), cached in {model_dir} (set XDG_CACHE_HOME to move "
          f"it)", file=sys.stderr)
    return model_dir


def has_nixl() -> bool:
    """Whether NIXL (prefill/decode disaggregation's transfer library) is installed."""
    return any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu13"))


__all__ = ["add_cors", "add_serve_parser", "checkpoint_of", "engine_config_of", "http_limits_of",
           "require_chat_encoding", "run_serve", "running_server", "uvicorn_options_of"]
