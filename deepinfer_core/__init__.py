"""DeepInfer: DeepSeek-V4 inference. The public API is exactly what this module exports."""

from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.llm import LLM
from deepinfer_core.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer_core.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "hookimpl"]
