"""DeepInfer: DeepSeek-V4 inference. The public API is exactly what this module exports.

The names load on first use (PEP 562): `import deepinfer_core.cli` (the `deepinfer` command) and
`import deepinfer_core.config` then import no torch, so `deepinfer --help` answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_core.lazy_exports import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)


__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "hookimpl"]
