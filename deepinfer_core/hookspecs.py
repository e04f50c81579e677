"""Every hook a DeepInfer plugin can implement, grouped by when it is called.

A plugin is a module registered under the `deepinfer` entry-point group; its functions are marked with
`deepinfer_core.hookimpl` and named exactly as below (a misspelt name is rejected at load time).

Factory hooks (`make_*`) run once, while the engine is built, never per step. They are
`firstresult`: the first implementation that returns something other than `None` wins and the rest
are not called. The pure-PyTorch reference implementations are registered first and marked `trylast`,
so any installed plugin is asked before them. A plugin that cannot serve a spec declines by
calling `decline("reason")` and returning `None`; `deepinfer plugins` and the "nothing could serve"
error show each reason with its plugin. Say why: `deepinfer plugins` credits the first plugin asked
that did not call `decline`, so a bare `None` is taken for the answer of a plugin asked after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

from deepinfer_core.backends import (
    AttentionBackend,
    AttentionSpec,
    EplbBackend,
    EplbSpec,
    GraphApi,
    LayerOps,
    LayerOpsSpec,
    LinearBackend,
    LinearSpec,
    MemoryCounters,
    MoEBackend,
    MoESpec,
    SamplingBackend,
    SamplingSpec,
    VerifyBackend,
    VerifySpec,
)

if TYPE_CHECKING:
    import torch

PROJECT_NAME = "deepinfer"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

FACTORY_PROTOCOLS: dict[str, type] = {
    "make_attention": AttentionBackend,
    "make_moe": MoEBackend,
    "make_layer_ops": LayerOps,
    "make_linear": LinearBackend,
    "make_eplb": EplbBackend,
    "make_sampler": SamplingBackend,
    "make_verifier": VerifyBackend,
}
"""Each factory hook and the Protocol its answer must satisfy (checked on every answer by
`deepinfer_core.plugins`); the one list of the factory hooks and their types."""

# ---------------------------------------------------------------------------------------------------
# Platform: called once per process, before anything is built.
# ---------------------------------------------------------------------------------------------------


@hookspec
def platforms() -> list[str]:
    """Name the platforms this plugin serves.

    Called when the platform is chosen. `DEEPINFER_ACCELERATOR=<name>` fails at once, naming the pip
    extra to install, when no installed plugin lists `<name>`. The reference plugin lists `cpu`.

    :returns: platform names such as `["nvidia"]` or `["ascend"]`.
    """


@hookspec(firstresult=True)
def detect_device(decline: Callable[[str], None]) -> torch.device | None:
    """Return the device this plugin's hardware offers on this machine, or `None` when there is none.

    Called only when `DEEPINFER_ACCELERATOR` is unset. First result wins; the reference returns the
    CPU, last.

    :param decline: call with a reason to record why this plugin found no device.
    :returns: a `torch.device`, or `None` to decline.
    """


# ---------------------------------------------------------------------------------------------------
# Backend factories: called once per distinct spec while the engine is built. firstresult.
# ---------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def make_attention(spec: AttentionSpec, device: torch.device, decline: Callable[[str], None]) -> AttentionBackend | None:
    """Build the attention backend (window + compressed attention with sinks, CSA indexer) for `spec`.

    :param spec: the layer kind's `AttentionSpec`.
    :param device: the device the model runs on.
    :param decline: call with a reason when returning `None`.
    :returns: an object satisfying `AttentionBackend`, or `None` to let the next plugin try.
    """


@hookspec(firstresult=True)
def make_moe(spec: MoESpec, device: torch.device, decline: Callable[[str], None]) -> MoEBackend | None:
    """Build the routed-MoE backend (routing, dispatch, experts, combine) for `spec`.

    :param spec: the layer kind's `MoESpec`.
    :param device: the device the model runs on.
    :param decline: call with a reason when returning `None`.
    :returns: an object satisfying `MoEBackend`, or `None` to let the next plugin try.
    """


@hookspec(firstresult=True)
def make_layer_ops(spec: LayerOpsSpec, device: torch.device, decline: Callable[[str], None]) -> LayerOps | None:
    """Build the layer ops (mHC mixing, RMSNorm, RoPE, compressor window close) for the model.

    Called once per model; the ops serve every layer, between its matmuls.

    :param spec: the model's `LayerOpsSpec`.
    :param device: the device the model runs on.
    :param decline: call with a reason when returning `None`.
    :returns: an object satisfying `LayerOps`, or `None` to let the next plugin try.
    """


@hookspec(firstresult=True)
def make_linear(spec: LinearSpec, device: torch.device, decline: Callable[[str], None]) -> LinearBackend | None:
    """Build the projection backend (`x @ W.T` on FP8 block-scaled weights) for `spec`.

    Called once per distinct projection kind of a model whose checkpoint keeps FP8 weights
    (`quantized_weights="native"`); dense projections never ask. The reference dequantises the weight
    per call; a plugin without an FP8 GEMM for `spec` declines, and start-up says who serves each spec.

    :param spec: the projection's `LinearSpec` (shapes, groups, weight format, scale tile and format).
    :param device: the device the model runs on.
    :param decline: call with a reason when returning `None`.
    :returns: an object satisfying `LinearBackend`, or `None` to let the next plugin try.
    """


@hookspec(firstresult=True)
def make_eplb(spec: EplbSpec, device: torch.device, decline: Callable[[str], None]) -> EplbBackend | None:
    """Build the expert-placement (EPLB) backend for `spec`.

    :param spec: the placement problem's `EplbSpec`.
    :param device: the device the model runs on.
    :param decline: call with a reason when returning `None`.
    :returns: an object satisfying `EplbBackend`, or `None` to let the next plugin try.
    """


@hookspec(firstresult=True)
def make_sampler(spec: SamplingSpec, device: torch.device, decline: Callable[[str], None]) -> SamplingBackend | None:
    """Build the sampler for `spec`.

    :param spec: the `SamplingSpec`.
    :param device: the device the model runs on.
    :param decline: call with a reason when returning `None`.
    :returns: an object satisfying `SamplingBackend`, or `None` to let the next plugin try.
    """


@hookspec(firstresult=True)
def make_verifier(spec: VerifySpec, device: torch.device, decline: Callable[[str], None]) -> VerifyBackend | None:
    """Build the speculative-decoding verifier for `spec`.

    :param spec: the `VerifySpec`.
    :param device: the device the model runs on.
    :param decline: call with a reason when returning `None`.
    :returns: an object satisfying `VerifyBackend`, or `None` to let the next plugin try.
    """


@hookspec(firstresult=True)
def graph_api(device: torch.device, decline: Callable[[str], None]) -> GraphApi | None:
    """Offer the graph-capture API for `device`, with which decode steps are captured once and replayed.

    Called once while the engine is built, when every backend declares `supports_cuda_graphs`. This is
    a first-result hook: the first non-None answer is used. Return None (calling `decline` with a
    reason) for a device you do not serve; when every plugin declines, decode runs eagerly. The
    reference plugin answers torch.cuda's API for CUDA devices.

    :param device: the device the model runs on.
    :param decline: call with a reason when returning None.
    :returns: a `deepinfer_core.backends.GraphApi`, or None.
    """


@hookspec(firstresult=True)
def memory_counters(device: torch.device, decline: Callable[[str], None]) -> MemoryCounters | None:
    """Offer `device`'s allocator counters, with which start-up measures the largest step's peak memory.

    Called once while the engine is built, after the weights load and before the KV cache is sized: the
    engine runs its worst-case step and sizes the cache from the measured peak (the transients no
    estimate sees, such as a layer's dequantised experts). First result wins. Return None (calling
    `decline` with a reason) for a device you do not serve; when every plugin declines, the peak is
    "not measured" and the cache is sized from free memory alone, as the log says. The reference plugin
    declines every device.

    :param device: the device the model runs on.
    :param decline: call with a reason when returning None.
    :returns: a `deepinfer_core.backends.MemoryCounters` bound to `device`, or None.
    """


# ---------------------------------------------------------------------------------------------------
# Registries: called once when the tokenizer / chat encoding for a checkpoint is looked up. Every
# implementation is called (not firstresult); each registers what it offers through the callback.
# ---------------------------------------------------------------------------------------------------


@hookspec
def register_tokenizers(register: Callable[..., None]) -> None:
    """Offer tokenizer loaders.

    Call `register(name, loader, priority=0)` where `loader(model_dir: Path, config) -> tokenizer | None`
    returns an object with `encode(text) -> list[int]` and `decode(ids) -> str`, or `None` when it
    cannot load that checkpoint's tokenizer. Higher priority loaders are tried first.

    :param register: the registration callback.
    """


@hookspec
def register_chat_encodings(register: Callable[..., None]) -> None:
    """Offer chat encodings (conversation -> prompt token ids, and streamed output parsing).

    Call `register(model_type, factory)` where `factory(tokenizer, config) -> encoding | None` returns
    an object satisfying `deepinfer_core.chat_contract.ChatEncoding` (its requests, errors and output
    streams are the `PreparedRequest`, `ApiError` and `OutputStream` of that module), or `None` when it
    cannot serve that checkpoint.

    :param register: the registration callback.
    """


@hookspec
def register_models(register: Callable[..., None]) -> None:
    """Offer model families beyond the built-in ones (`deepinfer_core.models.registry`).

    Call `register(model_type, architectures, model_class, config_class=...)`: `model_class` and
    `config_class` are `"package.module:Class"` strings imported on first use; the model class
    satisfies `deepinfer_core.models.interface.CausalLM`. An entry registered here is found before a
    built-in one of the same `model_type`.

    :param register: the registration callback.
    """



@hookspec
def register_prefix_stores(register: Callable[..., None]) -> None:
    """Offer prefix-store backends for `prefix_store_path` locations of the form `scheme://...` (3FS's
    native USRBIO client, Mooncake Store, ...); a plain directory path always uses POSIX files.

    Call `register(scheme, factory)` where `factory(location: str)` returns an object satisfying
    `deepinfer_core.kv.store_backends.StoreBackend` (named objects written atomically: `put`, `get` (bounded:
    `get(name, max_bytes)`), `contains`, `delete`, `touch`, `scan`); such a store's blocks are authenticated
    with `DEEPINFER_PREFIX_STORE_KEY` (`kv.store_key`). When two plugins register one scheme, the first asked wins.

    :param register: the registration callback.
    """

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]
