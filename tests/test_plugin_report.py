"""`deepinfer plugins`'s report: winners and decline reasons per hook and spec."""

from __future__ import annotations

import pytest

from deepinfer_core.backends import AttentionSpec
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugin_report import plugin_report
from deepinfer_core.plugins import FACTORY_PROTOCOLS
from tests.test_plugins import (
    ATTENTION,
    CPU,
    EPLB,
    LAYER_OPS,
    LINEAR,
    MOE,
    SAMPLING,
    VERIFY,
    ChipPlugin,
    DecliningPlugin,
)


def test_plugin_report_names_winners_and_declines(isolated_plugin_manager):
    isolated_plugin_manager.register(ChipPlugin(), name="chip")
    isolated_plugin_manager.register(DecliningPlugin(), name="decliner")
    wide = AttentionSpec(num_heads=2, head_dim=8, sliding_window=16, compress_rate=0)
    specs = {"make_attention": [ATTENTION, wide], "make_moe": [MOE], "make_layer_ops": [LAYER_OPS],
             "make_linear": [LINEAR], "make_eplb": [EPLB], "make_sampler": [SAMPLING], "make_verifier": [VERIFY]}
    report = plugin_report(CPU, specs)
    assert {info.name for info in report.plugins} == {"reference", "chip", "decliner"}
    by_hook = {}
    for choice in report.choices:
        by_hook.setdefault(choice.hook, []).append(choice)
    assert set(by_hook) == {"detect_device", *FACTORY_PROTOCOLS}
    assert by_hook["detect_device"][0].declines == {"decliner": "no chip on this machine"}
    assert by_hook["detect_device"][0].winner == "reference"
    served, declined = by_hook["make_attention"]
    assert (served.spec, served.winner, served.declines) == (ATTENTION, "chip", {"decliner": "no attention kernels here"})
    assert (declined.spec, declined.winner) == (wide, "reference")
    assert declined.declines == {"chip": "only sliding_window=4 is supported",
                                 "decliner": "no attention kernels here"}
    assert by_hook["make_moe"][0].declines == {"decliner": "no sqrtsoftplus routing kernel"}
    # the decliner's make_sampler returns None without a reason: it cannot be told from a winner, so the
    # first plugin asked that did not decline is credited (hookspecs: a plugin declining says why)
    assert [c.winner for c in by_hook["make_sampler"]] == ["decliner"]
    assert all(choice.result is None and choice.error is None for choice in report.choices)


def test_plugin_report_shows_a_failing_plugin_instead_of_raising(isolated_plugin_manager):
    class Crashing:
        @hookimpl
        def make_sampler(self, spec):
            raise RuntimeError("driver too old")

    isolated_plugin_manager.register(Crashing(), name="crashing")
    report = plugin_report(CPU, {"make_sampler": [SAMPLING]})
    choice = report.choices[-1]
    assert choice.winner is None
    assert choice.error == "RuntimeError: driver too old raised by plugin 'crashing' in make_sampler"
    with pytest.raises(ValueError, match="'platforms' is not a factory hook"):
        plugin_report(CPU, {"platforms": [None]})
