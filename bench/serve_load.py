"""Load on `deepinfer serve`: requests/s and time to first token at several concurrencies, plus the
prompt-encoding throughput of deepseek-recipe on a ~32K-token conversation.

    python bench/serve_load.py                        # the embedded tiny model, concurrency 1, 8, 32
    python bench/serve_load.py --model-dir CKPT --concurrency 1 64 --max-tokens 128

Prints one JSON line per measurement, then a short table.

Needs the serving extra and an HTTP client: `pip install httpx -e plugins/recipe` (checked first).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import time

# module -> what to install for it
# (from the checkout this script runs in: the recipe plugin brings the server's FastAPI and uvicorn)
REQUIREMENTS = {"httpx": "httpx", "fastapi": "-e plugins/recipe", "uvicorn": "-e plugins/recipe",
                "deepseek_recipe": "-e plugins/recipe", "deepinfer_recipe": "-e plugins/recipe"}


def missing_requirements() -> list[str]:
    """The `pip install` arguments for the modules this script needs and cannot find."""
    return list(dict.fromkeys(pip for module, pip in REQUIREMENTS.items() if importlib.util.find_spec(module) is None))


if __name__ == "__main__" and (missing := missing_requirements()):
    sys.exit(f"bench/serve_load.py needs more packages: pip install {' '.join(missing)}")

import httpx

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.engine import Engine
from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import running_server


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def one_request(client: httpx.AsyncClient, model: str, index: int, max_tokens: int) -> tuple[float, float]:
    """Stream one chat completion; returns (time to first token, total time) in seconds."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": f"Request {index}: write a short poem about the sea."}]}
    start = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    return first if first is not None else float("nan"), time.perf_counter() - start


async def load_level(base_url: str, model: str, concurrency: int, num_requests: int, max_tokens: int) -> dict:
    """`num_requests` requests, at most `concurrency` in flight."""
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def gated(index: int) -> tuple[float, float]:
            async with gate:
                return await one_request(client, model, index, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(i) for i in range(num_requests)))
        elapsed = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    return {"bench": "serve_load", "concurrency": concurrency, "requests": num_requests, "max_tokens": max_tokens,
            "requests_per_s": num_requests / elapsed, "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99), "latency_p50_s": percentile([r[1] for r in results], 50)}


def long_conversation(target_tokens: int, encode) -> tuple[object, int]:
    """A multi-turn conversation (with reasoning) that encodes to at least `target_tokens` tokens."""
    import deepseek_recipe as dr

    paragraph = ("The scheduler admits waiting requests while the step's token budget and the cache allow; "
                 "prefill is chunked so decodes keep flowing. ") * 8
    messages: list = [dr.SystemMessage("You review code carefully.")]
    turn = 0
    while True:
        messages.append(dr.UserMessage(f"Turn {turn}: review this.\n{paragraph}"))
        conversation = dr.Conversation(messages, thinking_mode=True)
        num_tokens = len(encode(conversation))
        if num_tokens >= target_tokens:
            return conversation, num_tokens
        messages.append(dr.AssistantMessage(f"Looks fine. {paragraph}", reasoning_content=f"Check turn {turn}."))
        turn += 1


def encode_throughput(model_dir: str, target_tokens: int, repeats: int) -> dict:
    """Median time of the recipe plugin's chat encoding on a long conversation."""
    from deepinfer_core.config import ModelConfig
    from deepinfer_core.entrypoints.chat import load_chat_encoding
    from deepinfer_core.tokenizer import load_tokenizer

    model_config = ModelConfig.from_dir(model_dir)
    encoding = load_chat_encoding(load_tokenizer(model_dir, model_config), model_config)
    conversation, num_tokens = long_conversation(target_tokens, encoding.encode)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        encoding.encode(conversation)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"bench": "encode", "tokens": num_tokens, "median_s": median, "tokens_per_s": num_tokens / median}


def print_table(rows: list[dict], encode_row: dict | None) -> None:
    print(f"\n{'concurrency':>11} {'req/s':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'latency p50 ms':>15}")
    for row in rows:
        print(f"{row['concurrency']:>11} {row['requests_per_s']:>8.2f} {row['ttft_p50_s'] * 1e3:>12.1f} "
              f"{row['ttft_p99_s'] * 1e3:>12.1f} {row['latency_p50_s'] * 1e3:>15.1f}")
    if encode_row:
        print(f"\nrecipe encode: {encode_row['tokens']} tokens in {encode_row['median_s'] * 1e3:.1f} ms "
              f"({encode_row['tokens_per_s'] / 1e6:.2f} M tok/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=None, help="checkpoint (default: the embedded tiny model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-level", type=int, default=None, help="default: 2 x concurrency, >= 8")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--device", default=None, help='torch device ("cpu", "cuda:0"); default detects it')
    parser.add_argument("--encode-tokens", type=int, default=32768, help="size of the encoding benchmark's prompt")
    parser.add_argument("--skip-encode", action="store_true")
    args = parser.parse_args()

    model_dir = args.model_dir
    if model_dir is None:
        from deepinfer_core.models.tiny import embedded_tiny_model_dir

        model_dir = str(embedded_tiny_model_dir())
    engine = Engine(EngineConfig(model=model_dir, device=args.device, enable_prefix_caching=True))
    app = build_app(engine)
    model = app.state.server.encoding.model_names[0]
    rows = []
    with running_server(app) as base_url:
        asyncio.run(load_level(base_url, model, 1, 1, 2))  # warm up
        for concurrency in args.concurrency:
            num_requests = args.requests_per_level or max(8, 2 * concurrency)
            row = asyncio.run(load_level(base_url, model, concurrency, num_requests, args.max_tokens))
            print(json.dumps(row), flush=True)
            rows.append(row)
    encode_row = None
    if not args.skip_encode:
        encode_row = encode_throughput(model_dir, args.encode_tokens, repeats=5)
        print(json.dumps(encode_row), flush=True)
    print_table(rows, encode_row)


if __name__ == "__main__":
    main()
