"""Prefill/decode disaggregation against one co-located instance: TTFT and decode tokens/s under a mixed load.

    python bench/pd.py [--model CKPT] [--requests 32] [--concurrency 8] [--quick]

Starts `deepinfer serve` (co-located), then `serve --role prefill`, `serve --role decode` and
`deepinfer router` on 127.0.0.1 (UCX over loopback: set UCX_NET_DEVICES for real NICs), and sends the
same mixed load to each setup through the openai SDK, streaming: `--requests` chat requests, half with
long prompts (agent-like: ~`--long-words` words) and half short, `--max-tokens` answer tokens each,
`--concurrency` at a time. Per setup one JSON line: mean and p90 time to first token, mean decode
tokens/s per request (answer tokens after the first / time after the first), requests/s, and whether
every answer equals the co-located one. Without `--model` the embedded tiny model is served (CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
NAME = "deepinfer-bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer_core.cli", *args, "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(args)} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not start")


def one_request(base_url: str, content: str, max_tokens: int) -> tuple[float, float, int, str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()
    first, text, tokens = None, [], 0
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            extra_body={"chat_template_kwargs": {"thinking": False}})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            tokens += 1
            text.append(chunk.choices[0].delta.content)
    end = time.perf_counter()
    first = first or end
    return first - start, (tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0, tokens, "".join(text)


def run_load(base_url: str, prompts: list[str], args) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda p: one_request(base_url, p, args.max_tokens), prompts))
    wall = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    return {"ttft_mean_s": round(statistics.mean(ttfts), 4), "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4),
            "decode_tok_s": round(statistics.mean(r[1] for r in results), 2), "requests_s": round(len(prompts) / wall, 3),
            "answers": [r[3] for r in results]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--long-words", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--serve-args", default="", help="extra `deepinfer serve` options, one string")
    parser.add_argument("--quick", action="store_true", help="4 requests, 2 at a time, short prompts")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.long_words, args.max_tokens = 4, 2, 200, 8
    prompts = [" ".join(f"step {j} of task {i} returned {j * i}." for j in range(args.long_words // 6))
               if i % 2 == 0 else f"Say hello to user {i}." for i in range(args.requests)]
    serve = ["serve", *([args.model] if args.model else []), "--served-model-name", NAME, *args.serve_args.split()]
    rows, procs, reference = [], [], None
    try:
        for setup in ("co-located", "disaggregated"):
            if setup == "co-located":
                proc, url = start([*serve, "--enable-prefix-caching"])
                procs.append(proc)
            else:
                prefill, prefill_url = start([*serve, "--role", "prefill"])
                decode, decode_url = start([*serve, "--role", "decode"])
                router, url = start(["router", "--prefill", prefill_url, "--decode", decode_url])
                procs += [prefill, decode, router]
            result = run_load(url, prompts, args)
            answers = result.pop("answers")
            reference = reference or answers
            row = {"bench": "pd", "setup": setup, "requests": args.requests, "concurrency": args.concurrency,
                   **result, "answers_equal_co_located": answers == reference}
            print(json.dumps(row), flush=True)
            rows.append(row)
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
            procs = []
    finally:
        for proc in procs:
            proc.kill()


if __name__ == "__main__":
    main()
