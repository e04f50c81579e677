"""`deepinfer plugins`: the loaded plugins, and which one answers each hook on this device, and why the
others declined. The caller says which specs to ask for (the CLI takes them from the checkpoint)."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core import hookspecs, plugins
from deepinfer_core.plugins import HookOutcome


@dataclass
class PluginInfo:
    """One loaded plugin."""

    name: str
    version: str
    platforms: list[str]
    hooks: list[str]


@dataclass
class PluginReport:
    """What `deepinfer plugins` prints."""

    device: torch.device
    plugins: list[PluginInfo]
    choices: list[HookOutcome]


def plugin_report(device: torch.device, specs: Mapping[str, Iterable[Any]]) -> PluginReport:
    """Every loaded plugin, who detects the device, and which one builds each backend for `device`.

    :param specs: by factory hook name, the specs to ask for (the caller knows the model; `deepinfer
        plugins` takes them from the checkpoint's layer plan). Each backend is built once per spec; a
        plugin that fails while building is reported, not raised.
    """
    pm = plugins.get_plugin_manager()
    versions = _plugin_versions()
    served = plugins.platforms()
    infos = [
        PluginInfo(name=name, version=versions.get(name, "-"), platforms=served.get(name, []),
                   hooks=sorted(caller.name for caller in pm.get_hookcallers(plugin) or []))
        for name, plugin in pm.list_name_plugin()
        if plugin is not None  # a blocked name is listed with no plugin
    ]
    choices = [_choose("detect_device")]
    for hook_name, hook_specs in specs.items():
        if hook_name not in plugins.FACTORY_PROTOCOLS:
            raise ValueError(f"{hook_name!r} is not a factory hook; "
                             f"choose from {sorted(plugins.FACTORY_PROTOCOLS)}")
        choices += [_choose(hook_name, spec=spec, device=device) for spec in hook_specs]
    return PluginReport(device=device, plugins=infos, choices=choices)


def _choose(hook_name: str, **kwargs: Any) -> HookOutcome:
    spec = kwargs.get("spec")
    try:
        outcome = plugins.ask(hook_name, **kwargs)
    except Exception as err:  # noqa: BLE001 -- the report shows a broken plugin instead of stopping at it
        notes = " ".join(getattr(err, "__notes__", []))
        error = f"{type(err).__name__}: {err} {notes}".strip()
        return HookOutcome(hook=hook_name, winner=None, spec=spec, error=error)
    outcome.spec, outcome.result = spec, None  # the report keeps no backend alive
    outcome.error = None if outcome.winner else "nobody can build it"
    return outcome


def _plugin_versions() -> dict[str, str]:
    versions = {}
    for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME):
        if ep.dist is not None:
            versions.setdefault(ep.name, ep.dist.version)
    return versions
