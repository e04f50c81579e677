"""The `deepinfer` command.

Subcommands register themselves through an `add_<name>_parser(subparsers)` function that adds a parser
and sets its `handler` default (a function taking the parsed arguments and returning an exit code);
`SUBCOMMANDS` says where each lives. Only the subcommand being run is imported, and only when it runs do
torch and the engine load: `deepinfer --help` and `deepinfer serve --help` import no torch. A subcommand
whose optional dependencies are missing answers with what to install.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from deepinfer_core.config import ModelConfig


def add_plugins_parser(subparsers: argparse._SubParsersAction) -> None:
    """`deepinfer plugins [--model DIR]`."""
    parser = subparsers.add_parser(
        "plugins", help=SUBCOMMANDS["plugins"].help,
        description="List installed plugins, their versions, and which plugin builds each backend on the "
                    "current device (with every decline reason).")
    parser.add_argument("--model", metavar="DIR",
                        help="checkpoint directory whose config.json gives the layer kinds to check "
                             "(default: DeepSeek-V4-Flash's)")
    parser.set_defaults(handler=run_plugins)


def run_plugins(args: argparse.Namespace) -> int:
    """Print the plugin report for the selected device."""
    import torch

    from deepinfer_core import plugins
    from deepinfer_core.config import ModelConfig
    from deepinfer_core.models import registry
    from deepinfer_core.plugin_report import plugin_report

    config = registry.load_model_config(args.model) if args.model else ModelConfig()
    device = plugins.select_device()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    print(format_report(plugin_report(device, representative_specs(config, dtype))))
    return 0


def representative_specs(config: ModelConfig, dtype: torch.dtype) -> dict[str, list[Any]]:
    """The specs the engine would ask for with `config`, by factory hook.

    Attention and MoE specs come from the model's layer plan, one per distinct layer kind; linear specs
    (FP8 checkpoints only) from its projections.
    """
    from deepinfer_core.backends import EplbSpec, SamplingSpec, VerifySpec
    from deepinfer_core.models import registry
    from deepinfer_core.models.layer_plan import layer_ops_spec
    from deepinfer_core.models.loading.weight_formats import fp8_linear_specs

    plans = registry.model_class(config).layer_plan(config, dtype)
    return {
        "make_attention": list(dict.fromkeys(plan.attention for plan in plans)),
        "make_moe": list(dict.fromkeys(plan.moe for plan in plans)),
        "make_layer_ops": [layer_ops_spec(config, dtype)],
        "make_linear": fp8_linear_specs(config, dtype),
        "make_eplb": [EplbSpec(num_layers=len(plans), num_experts=config.n_routed_experts,
                               num_slots=config.n_routed_experts)],
        "make_sampler": [SamplingSpec(vocab_size=config.vocab_size)],
        "make_verifier": [VerifySpec(vocab_size=config.vocab_size,
                                     max_draft_tokens=max(1, config.num_nextn_predict_layers))],
    }


def format_report(report) -> str:
    """The plugin report as two plain-text tables."""
    lines = [f"device: {report.device}", "", "plugins:"]
    plugin_rows = [(p.name, p.version, ",".join(p.platforms) or "-", ",".join(p.hooks)) for p in report.plugins]
    lines += _table(("name", "version", "platforms", "hooks"), plugin_rows)
    lines += ["", "backends:"]
    choice_rows = []
    for choice in report.choices:
        served_by = choice.winner or f"NONE ({choice.error})"
        declined = "; ".join(f"{plugin}: {reason}" for plugin, reason in choice.declines.items()) or "-"
        choice_rows.append((choice.hook, _describe_spec(choice.spec), served_by, declined))
    lines += _table(("hook", "spec", "served by", "declined"), choice_rows)
    return "\n".join(lines)


def _describe_spec(spec) -> str:
    """`Name(field=value, ...)` listing only fields that differ from their defaults."""
    if spec is None:
        return "-"
    fields = ", ".join(f"{f.name}={str(getattr(spec, f.name)).removeprefix('torch.')}"
                       for f in dataclasses.fields(spec)
                       if f.default is dataclasses.MISSING or getattr(spec, f.name) != f.default)
    return f"{type(spec).__name__}({fields})"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    # the last column is left unpadded so long decline reasons do not widen every line
    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(cell).ljust(w) for cell, w in zip(cells[:-1], widths)) + "  " + str(cells[-1])
    return [line(header)] + [line(row) for row in rows]


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """A `deepinfer` subcommand: its one-line help, and the module function that adds its parser."""

    help: str
    module: str
    add_parser: str


SUBCOMMANDS = {
    "plugins": Subcommand("list installed plugins and which one serves each hook on this machine",
                          "deepinfer_core.cli", "add_plugins_parser"),
    "serve": Subcommand("serve a checkpoint over HTTP (OpenAI and Anthropic APIs)",
                        "deepinfer_core.entrypoints.serve_cli", "add_serve_parser"),
    "router": Subcommand("route requests to prefill and decode instances (prefill/decode disaggregation)",
                         "deepinfer_core.entrypoints.router_cli", "add_router_parser"),
    "plan": Subcommand("size a deployment per rank (weights, KV cache, requests that fit) without loading weights",
                       "deepinfer_core.entrypoints.plan_cmd", "add_plan_parser"),
}
"""Only the subcommand being run has its module imported, so `deepinfer --help` imports no torch or server."""
EXTRA_OF_MODULE = {"httpx": "pd", "nixl": "pd", "nixl_cu13": "pd"}
"""The extra that installs an optional module; any other one of a subcommand's is the recipe extra's."""
class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but an option is never taken for a prefix of another (`--model` is not
    `--model-alias`): `allow_abbrev=False` here and in every subcommand's parser."""

    def __init__(self, *args: Any, allow_abbrev: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)


def add_subcommand(subparsers: argparse._SubParsersAction, name: str) -> None:
    """Add `name`'s parser from its module; when the module needs what is not installed, a parser that
    answers every argument with what to install."""
    command = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as err:
        if (err.name or "").startswith("deepinfer_core.") and err.name != command.module:
            raise  # our own module is missing: a broken install, not a missing extra
        # Whatever options follow, the answer is what to install, not "unrecognized arguments": with no
        # option prefix of its own, this parser takes every argument as one of its positionals.
        parser = subparsers.add_parser(name, help=command.help, add_help=False, prefix_chars="\0")
        parser.add_argument("ignored", nargs="*")
        parser.set_defaults(handler=functools.partial(_unavailable, command=name, missing=err.name))
        return
    getattr(module, command.add_parser)(subparsers)


def _unavailable(args: argparse.Namespace, command: str, missing: str | None) -> int:
    from deepinfer_core.plugins import install_hint

    extra = EXTRA_OF_MODULE.get((missing or "").partition(".")[0], "recipe")
    print(f"deepinfer {command} is not available ({missing} is not installed): {install_hint(extra)}",
          file=sys.stderr)
    return 2


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The `deepinfer` argument parser: every subcommand, with the full parsers of `commands` (None: all);
    the others are listed by name and help only, their modules not imported."""
    parser = ArgumentParser(prog="deepinfer", description="DeepSeek-V4 inference.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    full = set(SUBCOMMANDS if commands is None else commands)
    for name, command in SUBCOMMANDS.items():
        if name in full:
            add_subcommand(subparsers, name)
        else:
            subparsers.add_parser(name, help=command.help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `deepinfer` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # only the subcommand named (the first argument that is not an option) is built in full
    named = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser([named] if named in SUBCOMMANDS else []).parse_args(argv)
    try:
        return args.handler(args)
    except ModuleNotFoundError as err:  # an optional dependency the command needs when it runs (not for --help)
        if (err.name or "").startswith("deepinfer_core"):
            raise
        return _unavailable(args, args.command, err.name)
    except Exception as err:
        if not is_user_error(err):
            raise
        print(f"deepinfer {args.command}: error: {plain_error(err)}", file=sys.stderr)
        return 1


def is_user_error(err: Exception) -> bool:
    """Whether `err` is a problem the user fixes (printed as one line, no traceback): bad options or config
    (`ValueError`: `ConfigError`, `CheckpointError`, pydantic's errors), a feature not implemented, no plugin
    for the device."""
    from deepinfer_core.plugins import PluginError

    return isinstance(err, (ValueError, NotImplementedError, PluginError))


def plain_error(err: Exception) -> str:
    """`err` as plain sentences: a pydantic validation error without its envelope (the count, the error
    type, the link to pydantic's site); each error as `field: message`."""
    errors = getattr(err, "errors", None)
    if not callable(errors) or type(err).__name__ != "ValidationError":
        return str(err)
    parts = []
    for error in errors(include_url=False):
        message = str(error["msg"]).removeprefix("Value error, ")
        location = ".".join(str(part) for part in error["loc"])
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
