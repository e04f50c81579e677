"""The plugin manager, and one typed function per hook: the only module that calls `pm.hook`.

A plugin is a module registered under the `deepinfer` entry-point group (the entry point's name is the
plugin's canonical name, its value the `hooks` module). The built-in `reference` plugin is registered
first and its implementations are `trylast`, so any installed plugin is asked before it. pluggy does
the calling (first-result hooks stop at the first non-None answer) and the tracing; this module adds
the decline reasons, the allow/block lists and the accelerator check.

Environment overrides, read here and nowhere else:

- `DEEPINFER_ACCELERATOR` (`nvidia`, `ascend`, `cpu`): the platform to run on; unset, it is detected.
- `DEEPINFER_PLUGINS_ALLOW`: comma-separated plugin names; only these (and `reference`) are loaded.
- `DEEPINFER_PLUGINS_BLOCK`: comma-separated plugin names never loaded (`reference` included).
- `DEEPINFER_TRACE_PLUGINS=1`: pluggy's trace of every hook call and its answer, with who answered
  and why the plugins asked before it declined, on stderr.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import inspect
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy
import torch

from deepinfer_core import backends, hookspecs
from deepinfer_core.hookspecs import FACTORY_PROTOCOLS

REFERENCE_PLUGIN = "reference"
ENV_VARS = ("DEEPINFER_ACCELERATOR", "DEEPINFER_PLUGINS_ALLOW", "DEEPINFER_PLUGINS_BLOCK", "DEEPINFER_TRACE_PLUGINS")
"""The environment variables this module reads."""
ACCELERATOR_DEVICE_TYPES = {"nvidia": "cuda", "ascend": "npu", "cpu": "cpu"}
"""`DEEPINFER_ACCELERATOR` value -> torch device type."""
DEVICE_EXTENSIONS = {"npu": "torch_npu"}
"""Device type -> the vendor's torch extension that registers it with torch."""
# Hooks whose answer is credited to the plugin that returned it (a wrapper could replace it unseen).
_UNWRAPPED_HOOKS = ("platforms", "detect_device", "graph_api", "memory_counters", *FACTORY_PROTOCOLS)


class PluginError(RuntimeError):
    """A plugin cannot be loaded, or the environment asks for something no installed plugin offers."""


class BackendUnavailableError(PluginError):
    """Every plugin declined to build a backend; the message names each plugin and its reason."""


@dataclass
class HookOutcome:
    """Who answered one call of a first-result hook, and why the plugins asked before it declined."""

    hook: str
    winner: str | None
    declines: dict[str, str] = field(default_factory=dict)
    result: Any = None
    spec: Any = None
    """The spec asked for (`plugin_report`'s factory calls); None for `detect_device`."""
    error: str | None = None
    """Set by `plugin_report` when the winner, or every plugin, failed; shown instead of raised."""


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
    trace: bool = False,
) -> pluggy.PluginManager:
    """Build a validated plugin manager: the reference plugin first, then entry-point plugins.

    :param entry_points: plugins to load; None means the installed `deepinfer` entry points.
    :param allow: if given, only these entry-point plugins are loaded (the reference always is).
    :param block: plugins never loaded, the reference included.
    :param trace: write pluggy's trace of every hook call, with who answered, to stderr.
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
    if trace:
        pm.trace.root.setwriter(lambda text: sys.stderr.write(text))
        pm.add_hookcall_monitoring(lambda *args: None, functools.partial(_trace_answer, pm.trace.root.get("hook")))
        pm.enable_tracing()  # added last, so it wraps the line above: call, answer, then finish
    return pm


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built on first use from the installed plugins and the env."""
    return build_plugin_manager(allow=_env_names("DEEPINFER_PLUGINS_ALLOW"),
                                block=_env_names("DEEPINFER_PLUGINS_BLOCK") or (),
                                trace=os.environ.get("DEEPINFER_TRACE_PLUGINS", "") not in ("", "0"))


def reset_plugin_manager() -> None:
    """Forget the cached manager, so the next `get_plugin_manager()` loads plugins again (tests)."""
    get_plugin_manager.cache_clear()


def check_plugins(pm: pluggy.PluginManager) -> None:
    """Reject implementations of unknown hooks (a misspelt name) and wrappers around first-result hooks.

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
            if name in _UNWRAPPED_HOOKS and (impl.wrapper or impl.hookwrapper):
                raise PluginError(f"plugin {impl.plugin_name!r} wraps {name!r}, which takes no wrappers (the "
                                  "plugin that returns the answer is the one reported): return a result or None")


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
# Calling: pluggy calls the implementations (first result wins); `Declines` keeps who declined and why
# ---------------------------------------------------------------------------------------------------


class Declines:
    """The `decline` callback of one first-result call: keeps each reason with the plugin that gave it.

    pluggy asks the implementations in turn and stops at the first non-None answer; a reason belongs to
    the plugin whose implementation is on the call stack. The winner is the first plugin asked that did
    not decline, so an implementation that returns None should say why.
    """

    def __init__(self, impls: list[pluggy.HookImpl]) -> None:
        self.asked = [impl for impl in reversed(impls) if not (impl.wrapper or impl.hookwrapper)]
        self.reasons: dict[str, list[str]] = {}

    def __call__(self, reason: str) -> None:
        name = self.running(traceback.walk_stack(sys._getframe(1))) or "an unknown plugin"
        self.reasons.setdefault(name, []).append(str(reason))

    def running(self, frames: Iterable[tuple[types.FrameType, int]]) -> str | None:
        """The plugin whose implementation runs in the first of `frames` that runs one."""
        for frame, _ in frames:
            for impl in self.asked:
                if getattr(inspect.unwrap(impl.function), "__code__", None) is not frame.f_code:
                    continue
                owner = getattr(impl.function, "__self__", None)  # instances of one class share the code
                if owner is None or owner is frame.f_locals.get("self"):
                    return impl.plugin_name
        return None

    def outcome(self, hook_name: str, result: Any) -> HookOutcome:
        """Who answered, and the reasons of every plugin asked before it (of all, when nobody did)."""
        outcome = HookOutcome(hook=hook_name, winner=None, result=result)
        for name in (impl.plugin_name for impl in self.asked):
            if result is not None and name not in self.reasons:
                outcome.winner = name
                break
            outcome.declines[name] = "; ".join(self.reasons.get(name, [])) or "returned None without a reason"
        return outcome


def ask(hook_name: str, **kwargs: Any) -> HookOutcome:
    """Call a first-result hook through pluggy and learn who answered and why the others declined.

    :param kwargs: the hook's arguments but `decline` (each plugin gets its own via `Declines`).
    :raises Exception: whatever a plugin raised, with a note naming the plugin.
    """
    caller = getattr(get_plugin_manager().hook, hook_name)
    declines = Declines(caller.get_hookimpls())
    try:
        return declines.outcome(hook_name, caller(**kwargs, decline=declines))
    except Exception as err:
        if (plugin := declines.running(traceback.walk_tb(err.__traceback__))) is not None:
            err.add_note(f"raised by plugin {plugin!r} in {hook_name}")
        raise


def _trace_answer(hooktrace: Callable[..., None], outcome: pluggy.Result, hook_name: str,
                  impls: list[pluggy.HookImpl], kwargs: dict[str, Any]) -> None:
    """Under pluggy's trace of a first-result call: who answered, and each decline's plugin and reason."""
    declines = kwargs.get("decline")
    if isinstance(declines, Declines) and outcome.exception is None:
        answer = declines.outcome(hook_name, outcome.get_result())
        reasons = "; ".join(f"{plugin}: {reason}" for plugin, reason in answer.declines.items()) or "none"
        hooktrace(f"{hook_name} answered by {answer.winner or 'nobody'}; declined: {reasons}")


def _describe_declines(declines: dict[str, str]) -> str:
    if not declines:
        return "no installed plugin implements it"
    return "; ".join(f"{plugin}: {reason}" for plugin, reason in declines.items())


def _make(hook_name: str, spec: Any, device: torch.device) -> Any:
    outcome = ask(hook_name, spec=spec, device=device)
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
    """Platforms each plugin serves, by plugin name (the `platforms` hook), in the order plugins are asked."""
    caller = get_plugin_manager().hook.platforms
    return {impl.plugin_name: list(impl.function() or []) for impl in reversed(caller.get_hookimpls())}


PLUGIN_DIRECTORIES = {"nvidia": "nvidia_sm100", "ascend": "ascend950", "recipe": "recipe"}
"""Our plugin extras -> their source directories under plugins/."""


def install_hint(extra: str) -> str:
    """The command that installs `extra` of our pyproject, the README's way: `deepinfer` on PyPI is another
    project, so ours (and our plugins) install from the wheels `nox -s wheels` builds into dist/, or from a
    source checkout (a plugin extra from its directory under plugins/, any other extra from the root)."""
    source = f"plugins/{PLUGIN_DIRECTORIES[extra]}" if extra in PLUGIN_DIRECTORIES else f'".[{extra}]"'
    return (f'pip install --find-links dist "deepinfer[{extra}]" (the wheels `nox -s wheels` builds; from a source '
            f"checkout: pip install -e {source})")


def select_device() -> torch.device:
    """The device to run on: from `DEEPINFER_ACCELERATOR` when set, else the `detect_device` hook.

    :raises PluginError: the variable names an unknown platform, or one no installed plugin serves (the
        message names the pip extra to install), or a platform this machine cannot run (no CUDA device,
        no torch_npu), or no plugin detects a device.
    """
    accelerator = os.environ.get("DEEPINFER_ACCELERATOR", "").strip().lower()
    if not accelerator:
        outcome = ask("detect_device")
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
            fix = f"install its plugin with: {install_hint(accelerator)}"
        raise PluginError(f"DEEPINFER_ACCELERATOR={accelerator} but no installed plugin serves {accelerator!r}; "
                          f"{fix}")
    device_type = ACCELERATOR_DEVICE_TYPES[accelerator]
    problem = accelerator_problem(device_type)
    if problem is not None:
        raise PluginError(f"DEEPINFER_ACCELERATOR={accelerator} but this machine cannot run {device_type!r} "
                          f"devices: {problem}. Unset DEEPINFER_ACCELERATOR to use the detected device, or set "
                          "DEEPINFER_ACCELERATOR=cpu")
    return torch.device(device_type)


def accelerator_problem(device_type: str) -> str | None:
    """Why torch cannot use a `device_type` device on this machine, or None when it can."""
    if device_type == "cpu":
        return None
    try:
        if device_type in DEVICE_EXTENSIONS:
            importlib.import_module(DEVICE_EXTENSIONS[device_type])
        is_available = torch.get_device_module(device_type).is_available()
    except (ImportError, RuntimeError, AttributeError) as err:
        return f"torch {torch.__version__} cannot use {device_type!r} devices ({err})"
    return None if is_available else f"torch {torch.__version__} finds no {device_type!r} device"


def make_attention(spec: backends.AttentionSpec, device: torch.device) -> backends.AttentionBackend:
    """Build the attention backend for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_attention", spec, device)


def make_moe(spec: backends.MoESpec, device: torch.device) -> backends.MoEBackend:
    """Build the routed-MoE backend for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_moe", spec, device)


def make_layer_ops(spec: backends.LayerOpsSpec, device: torch.device) -> backends.LayerOps:
    """Build the layer ops for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_layer_ops", spec, device)


def make_linear(spec: backends.LinearSpec, device: torch.device) -> backends.LinearBackend:
    """Build the projection backend for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_linear", spec, device)


def make_eplb(spec: backends.EplbSpec, device: torch.device) -> backends.EplbBackend:
    """Build the EPLB backend for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_eplb", spec, device)


def make_sampler(spec: backends.SamplingSpec, device: torch.device) -> backends.SamplingBackend:
    """Build the sampler for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_sampler", spec, device)


def make_verifier(spec: backends.VerifySpec, device: torch.device) -> backends.VerifyBackend:
    """Build the speculative verifier for `spec` on `device`; raises `BackendUnavailableError` if none can."""
    return _make("make_verifier", spec, device)


def _device_object(hook: str, kind: type, device: torch.device):
    """The first answer to a device-keyed `hook`, checked to be a `kind`, or None when no plugin offers one."""
    outcome = ask(hook, device=device)
    if outcome.winner is not None and not isinstance(outcome.result, kind):
        raise PluginError(f"plugin {outcome.winner!r} returned {type(outcome.result).__name__} from {hook}, "
                          f"which is not a deepinfer_core.backends.{kind.__name__}")
    return outcome.result


def graph_api(device: torch.device) -> backends.GraphApi | None:
    """The graph-capture API for `device` (the `graph_api` hook), or None when no plugin offers one."""
    return _device_object("graph_api", backends.GraphApi, device)


def memory_counters(device: torch.device) -> backends.MemoryCounters | None:
    """`device`'s allocator counters (the `memory_counters` hook), or None when no plugin offers them."""
    return _device_object("memory_counters", backends.MemoryCounters, device)


def tokenizer_loaders() -> list[TokenizerLoader]:
    """Every registered tokenizer loader, highest priority first (ties keep plugin call order)."""
    loaders: list[TokenizerLoader] = []

    def register(name: str, loader: Callable[..., Any], priority: int = 0) -> None:
        loaders.append(TokenizerLoader(name=name, load=loader, priority=priority))

    get_plugin_manager().hook.register_tokenizers(register=register)
    loaders.sort(key=lambda loader: -loader.priority)
    return loaders


def chat_encodings() -> dict[str, Callable[..., Any]]:
    """Chat-encoding factories by `model_type`; when two plugins register one type, the first asked wins."""
    encodings: dict[str, Callable[..., Any]] = {}

    def register(model_type: str, factory: Callable[..., Any]) -> None:
        encodings.setdefault(model_type, factory)

    get_plugin_manager().hook.register_chat_encodings(register=register)
    return encodings


def prefix_store_backends() -> dict[str, Callable[[str], Any]]:
    """Prefix-store backend factories by URL scheme (`register_prefix_stores`); the first asked wins a scheme."""
    backends: dict[str, Callable[[str], Any]] = {}

    def register(scheme: str, factory: Callable[[str], Any]) -> None:
        backends.setdefault(scheme, factory)

    get_plugin_manager().hook.register_prefix_stores(register=register)
    return backends


def model_entries() -> list[tuple[str, tuple[str, ...], str, str]]:
    """Model families registered by plugins (`register_models`), in call order, each as
    `(model_type, architectures, model_class, config_class)` (`models.registry.ModelEntry`'s fields)."""
    entries = []

    def register(model_type: str, architectures, model_class: str,
                 config_class: str = "deepinfer_core.config:ModelConfig") -> None:
        entries.append((model_type, tuple(architectures), model_class, config_class))

    get_plugin_manager().hook.register_models(register=register)
    return entries
