"""The `deepinfer` command.

Subcommands register themselves through an `add_<name>_parser(subparsers)` function that adds a parser
and sets its `handler` default (a function taking the parsed arguments and returning an exit code).
`deepinfer serve` comes from `deepinfer_core.entrypoints.serve_cli.add_serve_parser` when the serving
dependencies are installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from deepinfer_core.config import ModelConfig


def add_plugins_parser(subparsers: argparse._SubParsersAction) -> None:
    """`deepinfer plugins [--model DIR]`."""
    parser = subparsers.add_parser(
        "plugins", help="list installed plugins and which one serves each hook on this machine",
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


def add_serve_parser_or_hint(subparsers: argparse._SubParsersAction) -> None:
    """`deepinfer serve`, from the serving module when it imports, else a parser that says what to install."""
    try:
        from deepinfer_core.entrypoints.serve_cli import add_serve_parser
    except ModuleNotFoundError as err:
        # Whatever options follow, the answer is what to install, not "unrecognized arguments": with no
        # option prefix of its own, this parser takes every argument as one of its positionals.
        parser = subparsers.add_parser("serve", help="serve a model over HTTP (needs the recipe extra)",
                                       add_help=False, prefix_chars="\0")
        parser.add_argument("ignored", nargs="*")
        parser.set_defaults(handler=functools.partial(_serve_unavailable, missing=err.name))
        return
    add_serve_parser(subparsers)


def _serve_unavailable(args: argparse.Namespace, missing: str | None) -> int:
    print(f'deepinfer serve is not available ({missing} is not installed): pip install "deepinfer[recipe]"',
          file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    """The `deepinfer` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4 inference.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_plugins_parser(subparsers)
    add_serve_parser_or_hint(subparsers)
    from deepinfer_core.entrypoints.plan_cmd import add_plan_parser  # argparse only: sizing loads when run

    add_plan_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `deepinfer` console script."""
    from deepinfer_core.plugins import PluginError

    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (PluginError, ValueError) as err:  # ValueError covers config errors
        print(f"deepinfer {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
