"""The `deepinfer serve` command: its options (vLLM's names for the engine's), and uvicorn.

    deepinfer serve /path/to/checkpoint --port 8000 --max-model-len 65536 --api-key "$KEY"
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI

from deepinfer_core.entrypoints.auth import API_KEY_ENV, PD_SECRET_ENV
from deepinfer_core.entrypoints.limits import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_HEADER_READ_TIMEOUT_S,
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    HttpLimits,
)
from deepinfer_core.entrypoints.serve import build_app

# `deepinfer serve` option -> EngineConfig field; unset options keep EngineConfig's defaults.
ENGINE_OPTIONS = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                  "enforce_eager", "cuda_graph_sizes", "enable_prefix_caching", "tensor_parallel_size",
                  "data_parallel_size", "context_parallel_size", "enable_expert_parallel", "enable_eplb",
                  "eplb_config", "speculative_config", "deterministic", "host_cache_gib", "prefix_store_path",
                  "prefix_store_gib", "prefix_store_ttl_s", "default_traffic_class", "engram_placement",
                  "engram_prefetch", "decoder_trimming")


def _dtype_choices() -> list[str]:
    from deepinfer_core.config import EngineConfig

    return list(typing.get_args(EngineConfig.model_fields["dtype"].annotation))


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to `deepinfer`'s argument parser."""
    parser = subparsers.add_parser("serve", help="serve a checkpoint over HTTP (OpenAI and Anthropic APIs)",
                                   description="Serve a checkpoint over HTTP: OpenAI Chat Completions, Responses "
                                               "and Completions, Anthropic Messages.")
    parser.add_argument("model_dir", nargs="?", default=None,
                        help="checkpoint directory; omitted, the embedded tiny model is served")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name responses report (default: the family's official name)")
    parser.add_argument("--model-alias", action="append", default=[], help="another accepted model name")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"key every /v1 request must present (Bearer, or x-api-key for Anthropic's API); "
                             f"default: ${API_KEY_ENV}, else none")
    engine = parser.add_argument_group("engine (vLLM's option names; unset ones keep the engine's defaults)")
    engine.add_argument("--dtype", choices=_dtype_choices(), default=None, help="weights and activations dtype")
    engine.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    engine.add_argument("--max-num-seqs", type=int, default=None, help="most requests in one step")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    engine.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="fraction of device memory to use (0, 1]")
    engine.add_argument("--enforce-eager", action="store_true", default=None, help="never capture CUDA graphs")
    engine.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None,
                        help="decode batch sizes captured as CUDA graphs: one value caps the default ladder, "
                             "several are used as given")
    engine.add_argument("--speculative-config", type=json.loads, default=None,
                        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    engine.add_argument("--enable-prefix-caching", action="store_true", default=None,
                        help="reuse cached prompt prefixes")
    engine.add_argument("--deterministic", action="store_true", default=None,
                        help="batch-invariant inference: a request's tokens and logprobs do not depend on what "
                             "shares its batch (costs throughput)")
    engine.add_argument("--engram-placement", choices=["device", "host"], default=None,
                        help="where DeepSeek-V4.1's Engram tables live (host: pinned host memory, decode eager)")
    engine.add_argument("--no-engram-prefetch", dest="engram_prefetch", action="store_false", default=None,
                        help="host-placed Engram tables: gather at the layer instead of on a worker thread ahead of it")
    engine.add_argument("--decoder-trimming", action="store_true", default=None,
                        help="DeepSeek-V4.1: run the layers after the candidate source only on each prompt's last "
                             "128 rows in prefill (faster, not exact; never for prompt-logprob requests)")
    add_parallel_arguments(engine)
    tiers = parser.add_argument_group("prefix tiers (need --enable-prefix-caching)")
    tiers.add_argument("--host-cache-gib", type=float, default=None,
                       help="GiB of pinned host memory holding prefix blocks behind the device cache")
    tiers.add_argument("--prefix-store-path", default=None,
                       help="directory (shared by several servers; a 3FS mount in production) or plugin URL of the "
                            "prefix store; its blocks outlive the process")
    tiers.add_argument("--prefix-store-gib", type=float, default=None, help="capacity of the prefix store in GiB")
    tiers.add_argument("--prefix-store-ttl", dest="prefix_store_ttl_s", action="append", type=_class_ttl, default=None,
                       metavar="CLASS=SECONDS", help="retention of a traffic class after its last use (repeatable; "
                       "default agent=259200 chat=604800); requests name theirs in the x-deepinfer-traffic-class header")
    tiers.add_argument("--default-traffic-class", default=None, help="class of requests that name none (default chat)")
    parser.add_argument("--role", choices=["prefill", "decode"], default=None,
                        help="prefill/decode disaggregation: a prefill instance computes prompts and exports their KV "
                             "blocks, a decode instance reads them by NIXL and answers; `deepinfer router` sits in "
                             "front (implies --enable-prefix-caching; a prefill instance's --host-cache-gib defaults to 1)")
    parser.add_argument("--public-url", default=None,
                        help="this server's base URL as other instances reach it (default http://HOST:PORT)")
    parser.add_argument("--prefill-url", action="append", default=[],
                        help="a decode instance's prefill instance (its --public-url), the only sources it reads KV "
                             f"from (repeatable); the router and instances share ${PD_SECRET_ENV}, else --api-key")
    http = parser.add_argument_group("HTTP limits")
    http.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                      help=f"largest request body accepted (default {DEFAULT_MAX_BODY_BYTES})")
    http.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT_S,
                      help=f"seconds a request body may take to arrive, then 408 (default {DEFAULT_BODY_READ_TIMEOUT_S:g})")
    http.add_argument("--header-read-timeout", type=float, default=DEFAULT_HEADER_READ_TIMEOUT_S,
                      help="seconds a request's headers may take to arrive, then the connection is closed "
                           f"(default {DEFAULT_HEADER_READ_TIMEOUT_S:g})")
    http.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY,
                      help=f"most connections served at once, 503 beyond (default {DEFAULT_LIMIT_CONCURRENCY})")
    http.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                      help=f"seconds an idle keep-alive connection stays open (default {DEFAULT_TIMEOUT_KEEP_ALIVE_S})")
    parser.set_defaults(handler=run_serve)
    from deepinfer_core.entrypoints.router import add_router_parser

    add_router_parser(subparsers)
    return parser


def _class_ttl(text: str) -> tuple[str, float]:
    name, sep, seconds = text.partition("=")
    try:
        return name, float(seconds) if sep else float("nan")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CLASS=SECONDS (e.g. agent=259200), got {text!r}") from None


def add_parallel_arguments(group: Any) -> None:
    """The parallel layout's options (vLLM's spellings; `deepinfer_core.backends.parallel`)."""
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                       help="ranks splitting attention heads and dense projections")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                       help="attention data-parallel ranks, each with its own requests and cache")
    group.add_argument("--context-parallel-size", type=int, default=None, help="ranks splitting a long prefill")
    group.add_argument("--enable-expert-parallel", action="store_true", default=None,
                       help="spread the routed experts over every rank (EP size = TP x DP)")
    group.add_argument("--enable-eplb", action="store_true", default=None, help="rebalance expert replicas by load")
    group.add_argument("--eplb-config", type=json.loads, default=None,
                       help='JSON, e.g. \'{"num_redundant_experts": 32, "window_size": 1000, "step_interval": 3000}\'')


def engine_config_of(args: argparse.Namespace, model_dir: str) -> Any:
    """The `EngineConfig` the parsed options ask for (options left unset keep its defaults)."""
    from deepinfer_core.config import EngineConfig

    chosen = {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name, None) is not None}
    if "prefix_store_ttl_s" in chosen:
        chosen["prefix_store_ttl_s"] = dict(chosen["prefix_store_ttl_s"])
    role = getattr(args, "role", None)
    if role is not None:
        chosen |= {"kv_transfer_role": role, "enable_prefix_caching": True}
        if role == "prefill":
            chosen.setdefault("host_cache_gib", 1.0)
    return EngineConfig(model=model_dir, **chosen)


def http_limits_of(args: argparse.Namespace) -> HttpLimits:
    """The HTTP limits the parsed options ask for."""
    return HttpLimits(max_body_bytes=args.max_body_bytes, body_read_timeout_s=args.body_read_timeout,
                      limit_concurrency=args.limit_concurrency, timeout_keep_alive_s=args.timeout_keep_alive,
                      header_read_timeout_s=args.header_read_timeout)


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
    """Build the engine for `args.model_dir` and serve it until interrupted."""
    import uvicorn

    from deepinfer_core.engine.data_parallel import build_engine

    model_dir = args.model_dir
    if model_dir is None:
        from deepinfer_core.models.tiny import embedded_tiny_model_dir

        model_dir = str(embedded_tiny_model_dir())
    require_chat_encoding(model_dir)
    if args.role is not None and not (os.environ.get(PD_SECRET_ENV) or args.api_key):
        from deepinfer_core.entrypoints.pd import NO_KEY_HINT

        raise ValueError(NO_KEY_HINT)  # before the weights load
    limits = http_limits_of(args)
    app = build_app(build_engine(engine_config_of(args, model_dir)), served_model_name=args.served_model_name,
                    model_aliases=args.model_alias, limits=limits, api_key=args.api_key,
                    public_url=args.public_url or f"http://{args.host}:{args.port}",
                    pd_secret=os.environ.get(PD_SECRET_ENV) or None, prefill_urls=args.prefill_url)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", **limits.uvicorn_options())
    return 0


__all__ = ["add_serve_parser", "engine_config_of", "http_limits_of", "require_chat_encoding", "run_serve",
           "running_server"]
