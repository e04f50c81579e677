"""`deepinfer serve`'s engine options, generated from `EngineConfig`'s fields.

Every field of `deepinfer_core.config.EngineConfig` is an option by construction: `--field-name`, its
help the field's description, its type, choices and default read from the field's annotation. So every
`LLM(...)` engine option is a `deepinfer serve` flag, and a field added later is one too. A few fields keep
a spelling of their own (`FLAG_SPELLINGS`: vLLM's short forms, `--role`) and one a parser of its own
(`--prefix-store-ttl CLASS=SECONDS`). `LLM(...)`'s own keywords that are not engine fields (`tokenizer`,
`quantization`, ...) are `VLLM_OPTIONS`. Nothing here imports torch: `deepinfer serve --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import os
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from deepinfer_core.config import EngineConfig
from deepinfer_core.config.engine import DTYPE_ALIASES

FLAG_SPELLINGS: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
    "data_parallel_size": ("--data-parallel-size", "-dp"),
    "kv_transfer_role": ("--role", "--kv-transfer-role"),
    "prefix_store_ttl_s": ("--prefix-store-ttl",),
}
"""Fields whose flags are not just `--field-name` (vLLM's short forms; the PD role's short name)."""
NOT_FLAGS = ("model",)
"""Fields given otherwise: the checkpoint is `deepinfer serve MODEL` or `--model MODEL`."""
GROUPS: dict[str, tuple[str, ...]] = {
    "parallel layout (vLLM's spellings)": (
        "tensor_parallel_size", "data_parallel_size", "context_parallel_size", "enable_expert_parallel",
        "enable_eplb", "eplb_config", "time_ep_dispatch", "distributed_executor_backend", "world_size",
        "worker_timeout_s"),
    "prefix cache tiers (need --enable-prefix-caching)": (
        "host_cache_gib", "prefix_store_path", "prefix_store_gib", "prefix_store_ttl_s", "default_traffic_class",
        "kv_transfer_role"),
}
"""Help sections; a field named in none is listed under the engine's own options."""
ENGINE_GROUP = "engine (vLLM's option names; unset options keep the engine's defaults)"
EXTRA_HELP = {
    "kv_transfer_role": " `deepinfer router` sits in front; implies --enable-prefix-caching, and a prefill "
                        "instance's --host-cache-gib defaults to 1.",
    "dtype": f" vLLM's {', '.join(DTYPE_ALIASES)} are accepted too.",
}
"""What the command line adds to a field's description."""


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one option per `EngineConfig` field (but `NOT_FLAGS`) and `VLLM_OPTIONS` to `parser`."""
    group_of = {name: title for title, names in GROUPS.items() for name in names}
    groups = {title: parser.add_argument_group(title) for title in (ENGINE_GROUP, *GROUPS)}
    for name, field in EngineConfig.model_fields.items():
        if name in NOT_FLAGS:
            continue
        flags = FLAG_SPELLINGS.get(name, ("--" + name.replace("_", "-"),))
        help_text = _help(field) + EXTRA_HELP.get(name, "")
        groups[group_of.get(name, ENGINE_GROUP)].add_argument(
            *flags, dest=name, default=None, help=help_text, **_argument_kind(name, field))
    add_vllm_options(groups[ENGINE_GROUP])


def add_vllm_options(group: Any) -> None:
    """vLLM's options that are `LLM(...)` keywords rather than engine fields, with what each does here."""
    group.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="tokenizer directory; only the checkpoint's own (its tokenizer.json) is implemented")
    group.add_argument("--trust-remote-code", action="store_true", default=False,
                       help="accepted for vLLM's command lines; nothing here runs checkpoint code")
    group.add_argument("--quantization", "-q", default=None,
                       help="None keeps the checkpoint's own precision; 'fp8' names a block-FP8 checkpoint's method "
                            "(quantising at load is not implemented)")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="pipeline parallelism is not implemented: only 1")


VLLM_OPTIONS = ("tokenizer", "trust_remote_code", "quantization", "pipeline_parallel_size")
"""`LLM(...)` keywords (not `EngineConfig` fields) that are options too."""


def check_vllm_options(model: str, tokenizer: str | None = None, expert_parallel_size: int = 1,
                       pipeline_parallel_size: int = 1) -> None:
    """Refuse the vLLM options this build accepts by name but cannot honour (`LLM(...)` and `deepinfer serve`).

    :raises NotImplementedError: naming the option.
    """
    if tokenizer is not None and os.path.realpath(tokenizer) != os.path.realpath(model):
        raise NotImplementedError("tokenizer: a tokenizer directory other than the model's (the checkpoint's own "
                                  "tokenizer.json is used)")
    if expert_parallel_size != 1:
        raise NotImplementedError("expert_parallel_size > 1 (DeepInfer 0.1's spelling): use "
                                  "enable_expert_parallel=True, which spreads the experts over every rank")
    if pipeline_parallel_size != 1:
        raise NotImplementedError("pipeline_parallel_size > 1 (pipeline parallelism); use tensor, data or "
                                  "context parallelism")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig` fields the parsed options set (those left unset keep the engine's defaults)."""
    chosen = {name: getattr(args, name) for name in EngineConfig.model_fields
              if name not in NOT_FLAGS and getattr(args, name, None) is not None}
    if "prefix_store_ttl_s" in chosen:
        chosen["prefix_store_ttl_s"] = dict(chosen["prefix_store_ttl_s"])
    return chosen


def _help(field: FieldInfo) -> str:
    text = (field.description or "").replace("%", "%%")  # argparse formats help with %
    if field.default is not None and not field.is_required() and field.default_factory is None:
        text += f" (default: {str(field.default).lower() if isinstance(field.default, bool) else field.default})"
    return text


def _argument_kind(name: str, field: FieldInfo) -> dict[str, Any]:
    """argparse's `type`/`choices`/`action`/`nargs` for a field, from its annotation."""
    if name == "prefix_store_ttl_s":
        return {"action": "append", "type": class_ttl, "metavar": "CLASS=SECONDS"}
    annotation = _unwrap(field.annotation)
    if name == "dtype":
        return {"choices": list(typing.get_args(annotation)), "type": lambda text: DTYPE_ALIASES.get(text, text)}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": list(typing.get_args(annotation))}
    if typing.get_origin(annotation) is tuple:
        return {"type": _unwrap(typing.get_args(annotation)[0]), "nargs": "+"}
    if typing.get_origin(annotation) is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return {"type": json_object, "metavar": "JSON"}
    if annotation in (int, float, str):
        return {"type": annotation}
    raise TypeError(f"EngineConfig.{name}: no command-line form for {annotation!r}; add one in engine_flags")


def _unwrap(annotation: Any) -> Any:
    """`X` of `X | None`, `Optional[X]` and `Annotated[X, ...]` (pydantic's PositiveInt)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(inner) == 1:
            return _unwrap(inner[0])
    return annotation


def json_object(text: str) -> dict[str, Any]:
    """A JSON object option (`--speculative-config '{"method": "ngram"}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def class_ttl(text: str) -> tuple[str, float]:
    """`CLASS=SECONDS` of `--prefix-store-ttl` (a missing value is NaN, which the config refuses by name)."""
    name, sep, seconds = text.partition("=")
    try:
        return name, float(seconds) if sep else float("nan")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CLASS=SECONDS (e.g. agent=259200), got {text!r}") from None


__all__ = ["FLAG_SPELLINGS", "NOT_FLAGS", "VLLM_OPTIONS", "add_engine_arguments", "check_vllm_options", "class_ttl", "engine_options",
           "json_object"]
