"""Offline inference with DeepInfer's `LLM` API.

    python examples/offline_inference.py [--max-tokens 32] [--temperature 0.8] [--dtype float32]

Runs the checkpoint in `DEEPINFER_HF_MODEL_DIR` when it is set. Otherwise it uses a tiny DeepSeek-V4
model with random weights and DeepSeek-V4's real tokenizer (built once under the user cache directory),
so the whole path - tokenizer, scheduler, cache, model, sampler - runs on a CPU in seconds. Its text
is gibberish: the weights are random.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.llm import MODEL_DIR_ENV

PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "The future of AI is",
    "In one sentence, a transformer is",
    "Write a haiku about the sea:",
    "The three primary colours are",
    "def fibonacci(n):",
    "DeepSeek-V4 compresses its KV cache by",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy (default 0.8)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="compute dtype (default: the checkpoint's)")
    parser.add_argument("--num-prompts", type=int, default=4,
                        help=f"how many prompts to run; cycles through {len(PROMPTS)} built-in ones (default 4)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    args = parser.parse_args()
    if args.max_tokens < 1 or args.num_prompts < 1:
        parser.error("--max-tokens and --num-prompts must be >= 1")
    return args


def model_dir() -> str:
    directory = os.environ.get(MODEL_DIR_ENV)
    if directory:
        return directory
    from deepinfer_core.models.tiny import embedded_tiny_model_dir

    print(f"{MODEL_DIR_ENV} is not set: using a tiny random DeepSeek-V4 model "
          "(built on first use, a few seconds, then cached) ...", flush=True)
    directory = embedded_tiny_model_dir()
    print(f"model: {directory}")
    return str(directory)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=model_dir(), dtype=args.dtype)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)

    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start

    for output in outputs:
        print("-" * 80)
        print(f"prompt:     {output.prompt!r}")
        print(f"completion: {output.outputs[0].text!r}")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("-" * 80)
    print(f"{len(outputs)} prompts, {num_tokens} new tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s")


if __name__ == "__main__":
    main()
