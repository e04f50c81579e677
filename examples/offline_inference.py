"""Offline inference with DeepInfer's `LLM` API.

    python examples/offline_inference.py [--max-tokens 32] [--temperature 0.8] [--dtype float32] [--family v41]

Runs the checkpoint in `DEEPINFER_HF_MODEL_DIR` when it is set. Otherwise it uses a tiny DeepSeek-V4
model (`--family v41` or `DEEPINFER_MODEL_FAMILY=v41`: a tiny DeepSeek-V4.1 one, in the official layout)
with random weights and the family's real tokenizer (built once under the user cache directory), so the
whole path - tokenizer, scheduler, cache, model, sampler - runs on a CPU in seconds. Its text is
gibberish: the weights are random.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.llm import MODEL_DIR_ENV
from deepinfer_core.models.tiny import MODEL_FAMILIES, embedded_model_dir

FAMILY_ENV = "DEEPINFER_MODEL_FAMILY"

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
    parser.add_argument("--family", choices=MODEL_FAMILIES, default=os.environ.get(FAMILY_ENV, "v4"),
                        help=f"embedded tiny model when {MODEL_DIR_ENV} is unset (default: ${FAMILY_ENV} or v4)")
    args = parser.parse_args()
    if args.max_tokens < 1 or args.num_prompts < 1:
        parser.error("--max-tokens and --num-prompts must be >= 1")
    return args


def model_dir(family: str) -> str:
    directory = os.environ.get(MODEL_DIR_ENV)
    if directory:
        return directory
    name = {"v4": "DeepSeek-V4", "v41": "DeepSeek-V4.1"}[family]
    print(f"{MODEL_DIR_ENV} is not set: using a tiny random {name} model "
          "(built on first use, a few seconds, then cached) ...", flush=True)
    directory = embedded_model_dir(family)
    print(f"model: {directory}")
    return str(directory)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=model_dir(args.family), dtype=args.dtype)
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
