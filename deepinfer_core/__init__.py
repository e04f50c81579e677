"""DeepInfer: DeepSeek-V4 inference. The public API is exactly what this module exports.

The names load on first use (PEP 562): `import deepinfer_core.cli` (the `deepinfer` command) and
`import deepinfer_core.config` then import no torch, so `deepinfer --help` answers at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer_core.hookspecs import hookimpl
    from deepinfer_core.llm import LLM
    from deepinfer_core.outputs import CompletionOutput, Logprob, RequestOutput
    from deepinfer_core.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

_MODULE_OF = {
    "LLM": "llm", "CompletionOutput": "outputs", "GuidedDecodingParams": "sampling_params", "Logprob": "outputs",
    "RequestOutput": "outputs", "SamplingParams": "sampling_params",
    "StructuredOutputsParams": "sampling_params", "hookimpl": "hookspecs",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF])


__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "hookimpl"]
