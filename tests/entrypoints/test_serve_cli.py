from __future__ import annotations

import argparse

from deepinfer_core.entrypoints.limits import DEFAULT_MAX_BODY_BYTES
from deepinfer_core.entrypoints.serve_cli import add_serve_parser, run_serve


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
