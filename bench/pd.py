"""Prefill/decode disaggregation against one co-located instance: TTFT and decode tokens/s under a mixed load.

    python bench/pd.py [--model CKPT] [--device cuda] [--requests 32] [--concurrency 8] [--quick]

Starts `deepinfer serve` (co-located), then `serve --role prefill`, `serve --role decode` and `deepinfer
router` on 127.0.0.1 (UCX over loopback: set UCX_NET_DEVICES for real NICs), and sends the same mixed
load to each setup through the openai SDK, streaming, greedy with thinking off (DeepSeek's `"thinking":
{"type": "disabled"}`: with thinking on the API samples at temperature 1.0): `--requests` chat requests,
half with long prompts (agent-like: ~`--long-words` words) and half short, `--max-tokens` answer tokens
each, `--concurrency` at a time, after the same load with other words, unreported (kernel compiles and
autotuning happen there, not in the first setup's figures). Per setup one JSON line: mean and p90 time
to first token, mean decode tokens/s per request (answer tokens after the first / time after the first),
requests/s, whether every answer equals the co-located one, and (disaggregated) the decode instance's
counters: prompt tokens it computed (0: every prompt came with its state from the prefill instance),
states and blocks it read. A last line compares the two. Equal answers are guaranteed bit for bit with
`--serve-args=--deterministic`; default mode's GPU kernels may break a near-tie another way when the
batch differs. Without `--model` the embedded tiny model is served.

`--device cuda`: with two or more GPUs visible the prefill instance gets GPU 0 and the decode instance
GPU 1; on one GPU they share it (each `--gpu-memory-utilization` 0.4, the co-located one 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
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


PD_SECRET = secrets.token_hex(16)


def launch(args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"), **(env or {})}
    env.setdefault("DEEPINFER_PD_SECRET", PD_SECRET)  # the instance key the router and instances share
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer_core.cli", *args, "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, what: str) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} at {url} did not start")


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)


def placement(device: str) -> dict[str, tuple[list[str], dict]]:
    """Per role, extra serve options and environment for `device` (see the module docstring)."""
    if device == "cpu":
        return {role: ([], {"CUDA_VISIBLE_DEVICES": ""}) for role in ("co-located", "prefill", "decode")}
    import torch

    if torch.cuda.device_count() >= 2:
        return {"co-located": ([], {"CUDA_VISIBLE_DEVICES": "0"}), "prefill": ([], {"CUDA_VISIBLE_DEVICES": "0"}),
                "decode": ([], {"CUDA_VISIBLE_DEVICES": "1"})}
    share = ["--gpu-memory-utilization", "0.4"]
    return {"co-located": (["--gpu-memory-utilization", "0.8"], {}), "prefill": (share, {}), "decode": (share, {})}


def one_request(base_url: str, content: str, max_tokens: int) -> tuple[float, float, int, str]:
    """(time to the first streamed token, decode tokens/s after it, streamed chunks, the text)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()
    first, text, tokens = None, [], 0
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            extra_body={"thinking": {"type": "disabled"}})
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        # a random model's answer may stream as reasoning text: every token counts
        piece = (delta.content or getattr(delta, "reasoning_content", None) or "") if delta is not None else ""
        if piece:
            first = first or time.perf_counter()
            tokens += 1
            text.append(piece)
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
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--long-words", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--serve-args", default="", help="extra `deepinfer serve` options, one string")
    parser.add_argument("--quick", action="store_true", help="4 requests, 2 at a time, short prompts")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency, args.long_words, args.max_tokens = 4, 2, 200, 8
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    def load(word: str) -> list[str]:
        return [" ".join(f"{word} {j} of task {i} returned {j * i}." for j in range(args.long_words // 6))
                if i % 2 == 0 else f"Say hello to user {i}." for i in range(args.requests)]

    prompts, warm_up = load("step"), load("stage")  # the same shapes, no shared prefix beyond the template
    serve = ["serve", *([args.model] if args.model else []), "--served-model-name", NAME, *args.serve_args.split()]
    where = placement(args.device)
    rows, procs, reference = [], [], None
    try:
        for setup in ("co-located", "disaggregated"):
            if setup == "co-located":
                options, env = where["co-located"]
                proc, url = launch([*serve, "--enable-prefix-caching", *options], env)
                procs.append(proc)
                wait_healthy(proc, url, "the co-located instance")
            else:  # the three start at once
                (p_options, p_env), (d_options, d_env) = where["prefill"], where["decode"]
                prefill, prefill_url = launch([*serve, "--role", "prefill", *p_options], p_env)
                decode, decode_url = launch([*serve, "--role", "decode", "--prefill-url", prefill_url, *d_options], d_env)
                router, url = launch(["router", "--prefill", prefill_url, "--decode", decode_url])
                procs += [prefill, decode, router]
                for proc, at, what in ((prefill, prefill_url, "prefill"), (decode, decode_url, "decode"),
                                       (router, url, "router")):
                    wait_healthy(proc, at, f"the {what} instance")
            run_load(url, warm_up, args)  # unreported: kernel compiles and autotuning happen here
            counted = {"decode_prompt_tokens_computed": "deepinfer_prefill_computed_tokens_total",
                       "decode_states_read": "deepinfer_kv_transfer_states_in_total",
                       "decode_blocks_read": "deepinfer_kv_transfer_blocks_in_total",
                       "transfer_failures": "deepinfer_kv_transfer_failures_total"} if setup == "disaggregated" else {}
            before = {key: metric(decode_url, name) for key, name in counted.items()}
            result = run_load(url, prompts, args)
            extra = {key: metric(decode_url, name) - before[key] for key, name in counted.items()}
            answers = result.pop("answers")
            reference = reference or answers
            row = {"bench": "pd", "setup": setup, "device": args.device, "requests": args.requests,
                   "concurrency": args.concurrency, **result, **extra, "answers_equal_co_located": answers == reference}
            print(json.dumps(row), flush=True)
            rows.append(row)
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
            procs = []
    finally:
        for proc in procs:
            proc.kill()
    co, pd = rows
    print(json.dumps({"bench": "pd_vs_co_located", "ttft_mean_ratio": round(pd["ttft_mean_s"] / co["ttft_mean_s"], 3),
                      "ttft_p90_ratio": round(pd["ttft_p90_s"] / co["ttft_p90_s"], 3),
                      "decode_tok_s_ratio": round(pd["decode_tok_s"] / co["decode_tok_s"], 3) if co["decode_tok_s"] else None,
                      "answers_equal": pd["answers_equal_co_located"]}), flush=True)


if __name__ == "__main__":
    main()
