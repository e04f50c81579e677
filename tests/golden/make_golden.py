"""Greedy outputs of the tiny V4 and V4.1 models, offline and served, saved so a refactor can prove it
changed nothing.

    python tests/golden/make_golden.py           # compare with tests/golden/outputs.json, bit for bit
    python tests/golden/make_golden.py --write   # (re)write outputs.json

Each offline case records every request's token ids and the chosen tokens' logprobs (as float.hex, so
the comparison is exact); a served case, the response's choices (JSON floats round-trip exactly). `tests/golden/test_golden.py` runs the same cases in the suite: token ids exactly,
logprobs to 1e-5 (another CPU may round the last bit differently; on the machine that wrote the file the
script's own check is exact).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUTPUTS = Path(__file__).with_name("outputs.json")

PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "def fibonacci(n):",
    "DeepSeek-V4 compresses its KV cache by " * 12,  # 96+ tokens: crosses a compressed window
]
MAX_TOKENS = 20

OFFLINE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v4": ("v4", {}),
    "v4_chunked_prefix": ("v4", {"max_num_batched_tokens": 32, "max_num_seqs": 4, "enable_prefix_caching": True}),
    "v4_async": ("v4", {"async_scheduling": True}),
    "v41": ("v41", {}),
    "v41_chunked": ("v41", {"max_num_batched_tokens": 32, "max_num_seqs": 4}),
}


def _completion(output) -> dict[str, Any]:
    completion = output.outputs[0]
    logprobs = [float(entry[token].logprob).hex() for token, entry in zip(completion.token_ids, completion.logprobs)]
    return {"token_ids": list(completion.token_ids), "logprobs": logprobs}


def offline_case(family: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.models.tiny import embedded_model_dir

    llm = LLM(model=str(embedded_model_dir(family)), dtype="float32", device="cpu", **options)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    results = [_completion(o) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    # a second pass: with prefix caching on, every prompt now hits the cache
    results += [_completion(o) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return results


def served_case() -> list[dict[str, Any]]:
    from fastapi.testclient import TestClient

    from deepinfer_core.entrypoints.serve import build_app
    from tests.entrypoints.live import SERVED_NAME, tiny_engine

    app = build_app(tiny_engine(async_scheduling=True), served_model_name=SERVED_NAME)
    results = []
    with TestClient(app) as client:
        for prompt in PROMPTS[:3]:
            body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}],
                    "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": True}
            results.append(client.post("/v1/chat/completions", json=body).json()["choices"])
            body = {"model": SERVED_NAME, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS}
            results.append(client.post("/v1/completions", json=body).json()["choices"])
    return results


def run_all() -> dict[str, list[dict[str, Any]]]:
    outputs = {name: offline_case(family, options) for name, (family, options) in OFFLINE_CASES.items()}
    outputs["served_v4"] = served_case()
    return outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write outputs.json instead of comparing")
    args = parser.parse_args()
    outputs = run_all()
    if args.write:
        OUTPUTS.write_text(json.dumps(outputs, indent=1) + "\n")
        print(f"wrote {OUTPUTS}")
        return 0
    saved = json.loads(OUTPUTS.read_text())
    differing = [name for name in saved if saved[name] != outputs.get(name)]
    print("bit-identical" if not differing else f"differ: {differing}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
