"""`LLM`: offline inference with vLLM's API (and DeepInfer 0.1's spellings)."""

from __future__ import annotations

import operator
import os
import secrets
import time
import warnings
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from deepinfer_core.config import EngineConfig
from deepinfer_core.config.engine import DTYPE_ALIASES
from deepinfer_core.engine.data_parallel import build_engine
from deepinfer_core.engine.input import check_sampling_params
from deepinfer_core.engine.output import apply_final_text
from deepinfer_core.entrypoints.engine_flags import check_vllm_options
from deepinfer_core.models import registry
from deepinfer_core.models.loading.checkpoint_files import require_checkpoint_dir
from deepinfer_core.models.loading.weight_formats import check_quantization
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling_params import SamplingParams

MODEL_DIR_ENV = "DEEPINFER_HF_MODEL_DIR"


def prompt_images(prompts: Any, count: int) -> list[list]:
    """Per prompt, the images of its vLLM `multi_modal_data` (empty when it has none)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if prompts is None:
        return [[] for _ in range(count)]
    found = []
    for prompt in prompts:
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            found.append([])
            continue
        if not isinstance(data, dict) or set(data) - {"image"}:
            others = sorted(set(data) - {"image"}) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"multi_modal_data takes only 'image' (a PIL.Image, bytes, or a list of them); got {others}")
        images = data.get("image")
        found.append(list(images) if isinstance(images, (list, tuple)) else [] if images is None else [images])
    return found


class LLM:
    """A DeepSeek-V4 model ready to generate.

    :param model: checkpoint directory (official DeepSeek or transformers layout); None reads
        `DEEPINFER_HF_MODEL_DIR`.
    :param dtype: "auto", "float32", "bfloat16" or "float16" (or vLLM's "half", "float", a `torch.dtype`).
    :param seed: seeds the per-request seeds of requests that give none; None draws one at random.
    :param max_model_len: longest prompt + output.
    :param tensor_parallel_size: ranks splitting attention heads and dense projections.
    :param quantization: None (vLLM's default) keeps the checkpoint's own precision: FP8 projections and
        FP4 experts stay in their bytes where a backend runs them (start-up says which, and who runs them),
        a bf16 checkpoint runs in bf16; "fp8" asks for the same of a checkpoint quantised so. Quantising a
        checkpoint that is not (vLLM's online quantisation) is not implemented. `dtype` sets activations.
    :param tokenizer: vLLM's tokenizer directory: None or the model's own (its tokenizer.json); another
        raises `NotImplementedError`.
    :param trust_remote_code: accepted for vLLM's code; nothing here runs checkpoint code.
    :param expert_parallel_size: DeepInfer 0.1's spelling; only 1 (use `enable_expert_parallel=True`).
    :param pipeline_parallel_size: only 1 (pipeline parallelism raises `NotImplementedError`).
    :param decode_sequence: DeepInfer 0.1's behaviour: `generate` returns the completions' texts, not
        `RequestOutput`s.
    :param engine_options: every other field of `EngineConfig` (`deepinfer_core/config/engine.py`, each
        field described there; `deepinfer serve --help` lists them as flags, and docs/cli.md): e.g.
        `max_num_seqs`, `max_num_batched_tokens`, `num_kv_blocks`, `gpu_memory_utilization`,
        `enable_prefix_caching`, the prefix cache's tiers (`host_cache_gib`, `prefix_store_path`,
        `prefix_store_gib`, `prefix_store_ttl_s`, `default_traffic_class`), `kv_transfer_role`
        (prefill/decode disaggregation), `swa_replay`, `device`, `cuda_graph_sizes`, `quantized_weights`,
        `async_scheduling`, `deterministic`, `engram_placement`, `engram_prefetch` and `decoder_trimming`
        (DeepSeek-V4.1), and the parallel layout (`data_parallel_size`, `context_parallel_size`,
        `enable_expert_parallel`, `enable_eplb`, `eplb_config`, `time_ep_dispatch`); a layout this build
        cannot run raises `NotImplementedError` naming it.
    """

    def __init__(self, model: str | None = None, dtype: Any = "auto", seed: int | None = 0,
                 max_model_len: int | None = None, *, tokenizer: str | None = None, trust_remote_code: bool = False,
                 expert_parallel_size: int = 1, tensor_parallel_size: int = 1, decode_sequence: bool = False,
                 quantization: str | None = None, pipeline_parallel_size: int = 1, **engine_options: Any) -> None:
        model = model or os.environ.get(MODEL_DIR_ENV)
        if not model:
            raise ValueError(f"no model given: pass LLM(model=<checkpoint dir>) or set {MODEL_DIR_ENV}")
        check_vllm_options(str(model), tokenizer, expert_parallel_size, pipeline_parallel_size)
        require_checkpoint_dir(model)  # a hub id or a wrong path: one sentence, before pydantic wraps it
        dtype = DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        seed = secrets.randbits(63) if seed is None else operator.index(seed)
        del trust_remote_code  # nothing here runs checkpoint code
        unknown = set(engine_options) - set(EngineConfig.model_fields)
        if unknown:
            raise TypeError(f"LLM() got unknown options {sorted(unknown)}; valid: {sorted(EngineConfig.model_fields)}")
        config = EngineConfig(model=str(model), dtype=dtype, seed=seed, max_model_len=max_model_len,
                              tensor_parallel_size=tensor_parallel_size, **engine_options)
        check_quantization(quantization, registry.load_model_config(config.model))
        self.engine = build_engine(config)  # one engine core per data-parallel rank when there are several
        self.decode_sequence = decode_sequence
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    # -- generate -----------------------------------------------------------------------------------

    def generate(self, prompts: Any = None, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 prompt_token_ids: Seq[Seq[int]] | None = None, use_tqdm: bool = True) -> list[RequestOutput] | list[str]:
        """Generate for every prompt; outputs come back in prompt order.

        :param prompts: a string, a `{"prompt": "..."}` or `{"prompt_token_ids": [...]}` dict (vLLM's
            TextPrompt and TokensPrompt), or a list of these. A dict may carry vLLM's
            `"multi_modal_data": {"image": image or [images]}` (`PIL.Image`s or encoded bytes), one
            `image_token_id` in the prompt where each image goes (DeepSeek-V4.1 with a vision tower).
        :param sampling_params: one `SamplingParams` for all prompts, or one per prompt; None: defaults.
        :param prompt_token_ids: DeepInfer 0.1 spelling: a list of token-id lists.
        :param use_tqdm: show a progress bar over requests.
        """
        requests = self._normalise_prompts(prompts, prompt_token_ids)
        params = self._normalise_params(sampling_params, len(requests))
        requests = [(text, self._truncate(ids, p)) for (text, ids), p in zip(requests, params)]
        engine = self.engine
        images = [engine.prepare_images(ids, found) if found else (ids, ())
                  for (_, ids), found in zip(requests, prompt_images(prompts, len(requests)))]
        requests = [(text, ids) for (text, _), (ids, _) in zip(requests, images)]
        for (text, ids), p in zip(requests, params):  # validate everything before any work starts
            engine.validate_prompt(ids)
            check_sampling_params(p, engine.model_config.vocab_size, engine.tokenizer, engine.eos_token_ids,
                                  token_history=True)
        engine.structured_output.wait_all([p.structured_outputs for p in params])  # bad grammars: ValueError
        ids_in_order = []
        for (text, ids), p, (_, laid) in zip(requests, params, images):
            request_id = str(self._counter)
            self._counter += 1
            self.engine.add_request(request_id, ids, p, prompt=text, images=laid)
            ids_in_order.append(request_id)
        finished = self._run(len(requests), use_tqdm)
        outputs = [apply_final_text(finished[i], p, engine.tokenizer) for i, p in zip(ids_in_order, params)]
        if self.decode_sequence:
            return [o.outputs[0].text for o in outputs]
        return outputs

    def _run(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, num_tokens = time.perf_counter(), 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        num_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{num_tokens / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            for request_id in self.engine.unfinished_request_ids():
                self.engine.abort(request_id)  # an interrupted generate leaves nothing queued
            raise
        finally:
            bar.close()
        return finished

    def _truncate(self, ids: list[int], params: SamplingParams) -> list[int]:
        """`truncate_prompt_tokens`: keep the last k ids (-1: as many as `max_model_len` leaves room for)."""
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = self.engine.config.max_model_len - 1
        return ids[-keep:] if keep is not None and len(ids) > keep else ids

    def _normalise_prompts(self, prompts: Any, prompt_token_ids: Any) -> list[tuple[str | None, list[int]]]:
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts (strings or {'prompt_token_ids': [...]}) or prompt_token_ids")
        if prompts is not None and prompt_token_ids is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if len(prompts) != len(prompt_token_ids):
                raise ValueError("prompts and prompt_token_ids must have the same length")
            return [(text, [int(t) for t in ids]) for text, ids in zip(prompts, prompt_token_ids)]
        if prompts is None:
            return [(None, [int(t) for t in ids]) for ids in prompt_token_ids]
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        return [self._one_prompt(p) for p in prompts]

    def _one_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenize(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids'; got keys {sorted(prompt)}")
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt is a string or a {{'prompt_token_ids': [...]}} dict, not {type(prompt).__name__}")
        return prompt, self.tokenize(prompt)

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> list[int]:
        """Deprecated alias of `tokenize` (for one release): in vLLM, `LLM.encode` is pooling.

        :raises NotImplementedError: for vLLM's pooling call (anything but one text).
        """
        if not isinstance(text, str) or args or kwargs:
            raise NotImplementedError("pooling (vLLM's LLM.encode); use LLM.tokenize(text) for token ids")
        warnings.warn("LLM.encode(text) is deprecated: vLLM's LLM.encode is pooling; use LLM.tokenize(text)",
                      DeprecationWarning, stacklevel=2)
        return self.tokenize(text)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a raw text prompt, with the model's BOS in front (no chat template)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json: pass {'prompt_token_ids': [...]} prompts")
        if not text:
            raise ValueError("the prompt is empty")
        ids = tokenizer.encode(text)
        bos = self.engine.model_config.bos_token_id
        return [bos, *ids] if bos is not None and (not ids or ids[0] != bos) else ids

    @staticmethod
    def _normalise_params(params: Any, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(params, SamplingParams):
            return [params.clone() for _ in range(count)]
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; give one, or one per prompt")
        bad = [type(p).__name__ for p in params if not isinstance(p, SamplingParams)]
        if bad:
            raise TypeError(f"sampling_params entries must be SamplingParams, got {bad}")
        return params

    # -- chat ---------------------------------------------------------------------------------------

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False, lora_request: Any = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, mm_processor_kwargs: dict[str, Any] | None = None,
             *, thinking: bool | None = None) -> list:
        """Answer one conversation or a list of them with the checkpoint's chat format (vLLM's signature).

        Returns one `ChatOutput` per conversation: vLLM's `RequestOutput` (`outputs[0].text`, token ids,
        logprobs) with the parsed `reasoning_content`, `content`, `tool_calls`, `finish_reason` and `usage`.

        :param continue_final_message: continue the last (assistant) message instead of opening a new
            turn (DeepSeek's prefix completion); needs `add_generation_prompt=False`.
        :param chat_template_kwargs: `{"thinking": bool}` (or `enable_thinking`) switches thinking mode,
            as `thinking=` does; None keeps the model's default (on).
        :param chat_template_content_format: read by Jinja templates only; every value renders the same here.
        :raises NotImplementedError: `chat_template` (the format is the plugin's, not a Jinja template),
            `add_generation_prompt=False` without `continue_final_message`, `lora_request`,
            `mm_processor_kwargs`, other `chat_template_kwargs`.
        See `deepinfer_core.entrypoints.chat.chat`.
        """
        from deepinfer_core.entrypoints.chat import TemplateOptions, chat

        if lora_request is not None:
            raise NotImplementedError("lora_request: LoRA adapters")
        if mm_processor_kwargs is not None:
            raise NotImplementedError("mm_processor_kwargs: multimodal inputs")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', "
                             f"got {chat_template_content_format!r}")
        options = TemplateOptions(chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs)
        return chat(self, messages, sampling_params, tools=tools, thinking=thinking, use_tqdm=use_tqdm, options=options)
