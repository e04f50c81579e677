"""The plugin manager, and one typed function per hook: the only module that calls `pm.hook`.

A plugin is a module registered under the `deepinfer` entry-point group (the entry point's name is the
plugin's canonical name, its value the `hooks` module). The built-in `reference` plugin is registered
first and its implementations are `trylast`, so any installed plugin is asked before it.

Environment overrides, read here and nowhere else:

- `DEEPINFER_ACCELERATOR` (`nvidia`, `ascend`, `cpu`): the platform to run on; unset, it is detected.
- `DEEPINFER_PLUGINS_ALLOW`: comma-separated plugin names; only these (and `reference`) are loaded.
- `DEEPINFER_PLUGINS_BLOCK`: comma-separated plugin names never loaded (`reference` included).
- `DEEPINFER_TRACE_PLUGINS=1`: print every hook call and the plugin that answered it to stderr.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy
import torch

from deepinfer_core import hookspecs
from deepinfer_core.backends import (
    AttentionBackend,
    AttentionSpec,
    EplbBackend,
    EplbSpec,
    LayerOps,
    LayerOpsSpec,
    MoEBackend,
    MoESpec,
    SamplingBackend,
    SamplingSpec,
    VerifyBackend,
    VerifySpec,
)

if TYPE_CHECKING:
    from deepinfer_core.config import ModelConfig

REFERENCE_PLUGIN = "reference"
ENV_VARS = ("DEEPINFER_ACCELERATOR", "DEEPINFER_PLUGINS_ALLOW", "DEEPINFER_PLUGINS_BLOCK", "DEEPINFER_TRACE_PLUGINS")
"""The environment variables this module reads."""
ACCELERATOR_DEVICE_TYPES = {"nvidia": "cuda", "ascend": "npu", "cpu": "cpu"}
"""`DEEPINFER_ACCELERATOR` value -> torch device type."""
FACTORY_PROTOCOLS: dict[str, type] = {
    "make_attention": AttentionBackend,
    "make_moe": MoEBackend,
    "make_layer_ops": LayerOps,
    "make_eplb": EplbBackend,
    "make_sampler": SamplingBackend,
    "make_verifier": VerifyBackend,
}
"""Every factory hook and the Protocol its result must satisfy."""
# Hooks whose implementations this module calls one at a time, to learn who answered and who declined.
_ONE_BY_ONE_HOOKS = ("platforms", "detect_device", *FACTORY_PROTOCOLS)


class PluginError(RuntimeError):
    """A plugin cannot be loaded, or the environment asks for something no installed plugin offers."""


class BackendUnavailableError(PluginError):
    """Every plugin declined to build a backend; the message names each plugin and its reason."""


@dataclass
class HookOutcome:
    """Who answered one call of a first-result hook, and why the plugins asked before it declined."""

    hook: str
    result: Any
    winner: str | None
    declines: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenizerLoader:
    """A tokenizer loader offered through `register_tokenizers`."""

    name: str
    load: Callable[..., Any]
    """`load(model_dir, config) -> tokenizer | None`."""
    priority: int = 0


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def build_plugin_manager(
    entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
    allow: Iterable[str] | None = None,
    block: Iterable[str] = (),
) -> pluggy.PluginManager:
    """Build a validated plugin manager: the reference plugin first, then entry-point plugins.

    :param entry_points: plugins to load; None means the installed `deepinfer` entry points.
    :param allow: if given, only these entry-point plugins are loaded (the reference always is).
    :param block: plugins never loaded, the reference included.
    :raises PluginError: a plugin fails to import, implements an unknown hook or has a bad signature.
    """
    from deepinfer_core.reference import hooks as reference_hooks

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for name in block:
        pm.set_blocked(name)
    if not pm.is_blocked(REFERENCE_PLUGIN):
        _register(pm, reference_hooks, REFERENCE_PLUGIN)
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME)
    entry_points = list(entry_points)
    allowed = None if allow is None else set(allow)
    if allowed is not None:
        _check_allow_list(allowed, {ep.name for ep in entry_points})
    for ep in entry_points:
        if pm.has_plugin(ep.name) or pm.is_blocked(ep.name) or (allowed is not None and ep.name not in allowed):
            continue
        try:
            module = ep.load()
        except Exception as err:
            raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to import: {err!r}. "
                              f"{_block_hint(ep.name)}") from err
        _register(pm, module, ep.name)
    check_plugins(pm)
    return pm


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built on first use from the installed plugins and the env."""
    return build_plugin_manager(allow=_env_names("DEEPINFER_PLUGINS_ALLOW"),
                                block=_env_names("DEEPINFER_PLUGINS_BLOCK") or ())


def reset_plugin_manager() -> None:
    """Forget the cached manager, so the next `get_plugin_manager()` loads plugins again (tests)."""
    get_plugin_manager.cache_clear()


def check_plugins(pm: pluggy.PluginManager) -> None:
    """Reject implementations of unknown hooks (a misspelt name) and wrappers around one-by-one hooks.

    :raises PluginError: naming the plugin and the offending hook.
    """
    known = sorted(name for name in vars(pm.hook) if not name.startswith("_") and getattr(pm.hook, name).has_spec())
    for name, caller in vars(pm.hook).items():
        if name.startswith("_"):
            continue
        for impl in caller.get_hookimpls():
            if not caller.has_spec() and not impl.optionalhook:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise PluginError(f"plugin {impl.plugin_name!r} implements unknown hook {name!r}{hint}; "
                                  f"known hooks: {', '.join(known)}. {_block_hint(impl.plugin_name)}")
            if name in _ONE_BY_ONE_HOOKS and (impl.wrapper or impl.hookwrapper):
                raise PluginError(f"plugin {impl.plugin_name!r} wraps {name!r}, which takes no wrappers: "
                                  "return a result or None instead")


def _register(pm: pluggy.PluginManager, module: object, name: str) -> None:
    try:
        pm.register(module, name=name)
    except pluggy.PluginValidationError as err:
        detail = str(err).replace("\n", "; ")
        raise PluginError(f"plugin {name!r} is invalid: {detail}. {_block_hint(name)}") from err


def _check_allow_list(allowed: set[str], installed: set[str]) -> None:
    unknown = allowed - installed - {REFERENCE_PLUGIN}
    if unknown:
        raise PluginError(f"DEEPINFER_PLUGINS_ALLOW names {sorted(unknown)}, which are not installed; "
                          f"installed plugins: {sorted(installed)}")


def _block_hint(name: str) -> str:
    return f"Fix or uninstall it, or set DEEPINFER_PLUGINS_BLOCK={name} to skip it."


def _env_names(variable: str) -> list[str] | None:
    value = os.environ.get(variable)
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


# ---------------------------------------------------------------------------------------------------
# Calling
# ---------------------------------------------------------------------------------------------------


def _is_tracing() -> bool:
    return os.environ.get("DEEPINFER_TRACE_PLUGINS", "") not in ("", "0")


def _trace(message: str) -> None:
    if _is_tracing():
        print(f"[deepinfer plugins] {message}", file=sys.stderr)


def _first_result(hook_name: str, **kwargs: Any) -> HookOutcome:
    """Ask implementations in pluggy's order (tryfirst first, trylast last) until one returns non-None.

    Each implementation gets its own `decline` callback, so every reason is kept with its plugin.
    """
    caller = getattr(get_plugin_manager().hook, hook_name)
    outcome = HookOutcome(hook=hook_name, result=None, winner=None)
    for impl in reversed(caller.get_hookimpls()):
        reasons: list[str] = []
        available = {**kwargs, "decline": reasons.append}
        try:
            result = impl.function(*(available[arg] for arg in impl.argnames))
        except Exception as err:
            err.add_note(f"raised by plugin {impl.plugin_name!r} in {hook_name}")
            raise
        if result is not None:
            outcome.result, outcome.winner = result, impl.plugin_name
            break
        outcome.declines[impl.plugin_name] = "; ".join(reasons) or "returned None without a reason"
    args = ", ".join(repr(value) for value in kwargs.values())
    _trace(f"{hook_name}({args}) -> {outcome.winner or 'nobody'}; declined: {outcome.declines or 'none'}")
    return outcome


def _describe_declines(declines: dict[str, str]) -> str:
    if not declines:
        return "no installed plugin implements it"
    return "; ".join(f"{plugin}: {reason}" for plugin, reason in declines.items())


def _make(hook_name: str, spec: Any, device: torch.device) -> Any:
    outcome = _first_result(hook_name, spec=spec, device=device)
    if outcome.winner is None:
        raise BackendUnavailableError(f"no plugin can {hook_name.removeprefix('make_')} {spec} on {device}. "
                                      f"Declined: {_describe_declines(outcome.declines)}")
    protocol = FACTORY_PROTOCOLS[hook_name]
    if not isinstance(outcome.result, protocol):
        raise PluginError(f"plugin {outcome.winner!r} returned {type(outcome.result).__name__} from "
                          f"{hook_name}, which does not satisfy {protocol.__name__}")
    return outcome.result


# ---------------------------------------------------------------------------------------------------
# One typed function per hook
# ---------------------------------------------------------------------------------------------------


def platforms() -> dict[str, list[str]]:
    """Platforms each plugin serves, by plugin name (the `platforms` hook)."""
    caller = get_plugin_manager().hook.platforms
    served = {impl.plugin_name: list(impl.function() or []) for impl in reversed(caller.get_hookimpls())}
    _trace(f"platforms() -> {served}")
    return served


def select_device() -> torch.device:
    """The device to run on: from `DEEPINFER_ACCELERATOR` when set, else the `detect_device` hook.

    :raises PluginError: the variable names an unknown platform, or one no installed plugin serves (the
        message names the pip extra to install), or no plugin detects a device.
    """
    accelerator = os.environ.get("DEEPINFER_ACCELERATOR", "").strip().lower()
    if not accelerator:
        outcome = _first_result("detect_device")
        if outcome.winner is None:
            raise PluginError(f"no plugin detected a device. Declined: {_describe_declines(outcome.declines)}")
        return outcome.result
    if accelerator not in ACCELERATOR_DEVICE_TYPES:
        raise PluginError(f"DEEPINFER_ACCELERATOR={accelerator!r} is not one of "
                          f"{sorted(ACCELERATOR_DEVICE_TYPES)}; unset it to detect the device")
    if not any(accelerator in served for served in platforms().values()):
        if accelerator == "cpu":
            fix = f"the built-in {REFERENCE_PLUGIN!r} plugin serves it: remove it from DEEPINFER_PLUGINS_BLOCK"
        else:
            fix = f'install its plugin with: pip install "deepinfer[{accelerator}]"'
        raise PluginError(f"DEEPINFER_ACCELERATOR={accelerator} but no installed plugin serves {accelerator!r}; "
                          f"{fix}")
    device_type = ACCELERATOR_DEVICE_TYPES[accelerator]
    try:
        return torch.device(device_type)
    except RuntimeError as err:
        raise PluginError(f"DEEPINFER_ACCELERATOR={accelerator} but torch does not know the device type "
                          f"{device_type!r} (is the vendor's torch extension installed?): {err}") from err


def make_attention(spec: AttentionSpec, device: torch.device) -> AttentionBackend:
    """Build the attention backend for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_attention", spec, device)


def make_moe(spec: MoESpec, device: torch.device) -> MoEBackend:
    """Build the routed-MoE backend for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_moe", spec, device)


def make_layer_ops(spec: LayerOpsSpec, device: torch.device) -> LayerOps:
    """Build the layer ops for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_layer_ops", spec, device)


def make_eplb(spec: EplbSpec, device: torch.device) -> EplbBackend:
    """Build the EPLB backend for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_eplb", spec, device)


def make_sampler(spec: SamplingSpec, device: torch.device) -> SamplingBackend:
    """Build the sampler for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_sampler", spec, device)


def make_verifier(spec: VerifySpec, device: torch.device) -> VerifyBackend:
    """Build the speculative verifier for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_verifier", spec, device)


def tokenizer_loaders() -> list[TokenizerLoader]:
    """Every registered tokenizer loader, highest priority first (ties keep plugin call order)."""
    loaders: list[TokenizerLoader] = []

    def register(name: str, loader: Callable[..., Any], priority: int = 0) -> None:
        loaders.append(TokenizerLoader(name=name, load=loader, priority=priority))

    get_plugin_manager().hook.register_tokenizers(register=register)
    loaders.sort(key=lambda loader: -loader.priority)
    _trace(f"register_tokenizers -> {[loader.name for loader in loaders]}")
    return loaders


def chat_encodings() -> dict[str, Callable[..., Any]]:
    """Chat-encoding factories by `model_type`; when two plugins register one type, the first asked wins."""
    encodings: dict[str, Callable[..., Any]] = {}

    def register(model_type: str, factory: Callable[..., Any]) -> None:
        encodings.setdefault(model_type, factory)

    get_plugin_manager().hook.register_chat_encodings(register=register)
    _trace(f"register_chat_encodings -> {sorted(encodings)}")
    return encodings


def model_entries() -> list:
    """Model families registered by plugins (`register_models`), as `ModelEntry`s in call order."""
    from deepinfer_core.models.registry import ModelEntry

    entries = []

    def register(model_type: str, architectures, model_class: str,
                 config_class: str = "deepinfer_core.config:ModelConfig") -> None:
        entries.append(ModelEntry(model_type, tuple(architectures), model_class, config_class))

    get_plugin_manager().hook.register_models(register=register)
    return entries


# ---------------------------------------------------------------------------------------------------
# Report (`deepinfer plugins`)
# ---------------------------------------------------------------------------------------------------


@dataclass
class PluginInfo:
    """One loaded plugin."""

    name: str
    version: str
    platforms: list[str]
    hooks: list[str]


@dataclass
class HookChoice:
    """Which plugin answered one hook (a factory hook for one representative spec, or `detect_device`)."""

    hook: str
    spec: Any
    """The spec asked for; None for `detect_device`."""
    winner: str | None
    declines: dict[str, str]
    error: str | None = None
    """Set when the winner, or every plugin, failed; the report shows it instead of raising."""


@dataclass
class PluginReport:
    """What `deepinfer plugins` prints."""

    device: torch.device
    plugins: list[PluginInfo]
    choices: list[HookChoice]


def representative_specs(config: ModelConfig | None = None,
                         dtype: torch.dtype = torch.float32) -> dict[str, list[Any]]:
    """The specs the engine would ask for with `config` (V4-Flash defaults when None), by factory hook.

    Attention and MoE specs come from the model's layer plan, one per distinct layer kind.
    """
    from deepinfer_core.config import ModelConfig
    from deepinfer_core.models.layer_plan import build_layer_plan, layer_ops_spec

    config = config or ModelConfig()
    plans = build_layer_plan(config, dtype)
    return {
        "make_attention": list(dict.fromkeys(plan.attention for plan in plans)),
        "make_moe": list(dict.fromkeys(plan.moe for plan in plans)),
        "make_layer_ops": [layer_ops_spec(config, dtype)],
        "make_eplb": [EplbSpec(num_layers=len(plans), num_experts=config.n_routed_experts,
                               num_slots=config.n_routed_experts)],
        "make_sampler": [SamplingSpec(vocab_size=config.vocab_size)],
        "make_verifier": [VerifySpec(vocab_size=config.vocab_size,
                                     max_draft_tokens=max(1, config.num_nextn_predict_layers))],
    }


def plugin_report(device: torch.device, config: ModelConfig | None = None) -> PluginReport:
    """Every loaded plugin, who detects the device, and which one builds each backend for `device`.

    Builds each backend once per representative spec (see `representative_specs`); a plugin that fails
    while building is reported, not raised.
    """
    pm = get_plugin_manager()
    versions = _plugin_versions()
    served = platforms()
    infos = [
        PluginInfo(name=name, version=versions.get(name, "-"), platforms=served.get(name, []),
                   hooks=sorted(caller.name for caller in pm.get_hookcallers(plugin) or []))
        for name, plugin in pm.list_name_plugin()
        if plugin is not None  # a blocked name is listed with no plugin
    ]
    choices = [_choose("detect_device", asked_for=None)]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    for hook_name, specs in representative_specs(config, dtype).items():
        choices += [_choose(hook_name, asked_for=spec, spec=spec, device=device) for spec in specs]
    return PluginReport(device=device, plugins=infos, choices=choices)


def _choose(hook_name: str, asked_for: Any, **kwargs: Any) -> HookChoice:
    try:
        outcome = _first_result(hook_name, **kwargs)
    except Exception as err:  # noqa: BLE001 -- the report shows a broken plugin instead of stopping at it
        notes = " ".join(getattr(err, "__notes__", []))
        return HookChoice(hook=hook_name, spec=asked_for, winner=None, declines={},
                          error=f"{type(err).__name__}: {err} {notes}".strip())
    error = None if outcome.winner else "nobody can build it"
    return HookChoice(hook=hook_name, spec=asked_for, winner=outcome.winner, declines=outcome.declines,
                      error=error)


def _plugin_versions() -> dict[str, str]:
    versions = {}
    for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME):
        if ep.dist is not None:
            versions.setdefault(ep.name, ep.dist.version)
    return versions
