"""The `deepinfer` command."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from deepinfer_core import cli
from deepinfer_core.hookspecs import hookimpl


class Chip:
    @hookimpl
    def platforms(self):
        return ["chip"]

    @hookimpl
    def make_moe(self, decline):
        decline("no grouped GEMM yet")


def test_plugins_lists_winners_and_declines(isolated_plugin_manager, capsys):
    isolated_plugin_manager.register(Chip(), name="chip")
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("device: cpu\n")
    plugin_lines = {line.split()[0]: line for line in out.split("backends:")[0].splitlines()[4:] if line}
    assert set(plugin_lines) == {"reference", "chip"}
    assert "make_moe" in plugin_lines["chip"].split()[-1]
    moe_lines = [line for line in out.splitlines() if line.startswith("make_moe ")]
    assert len(moe_lines) == 2  # V4-Flash has hash and top-k MoE layers
    assert all("reference" in line and "chip: no grouped GEMM yet" in line for line in moe_lines)
    attention_lines = [line for line in out.splitlines() if line.startswith("make_attention ")]
    assert any("compress_rate=4, index_n_heads=64" in line for line in attention_lines)


def test_plugins_reads_the_model_config(isolated_plugin_manager, tmp_path, capsys):
    config = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "sliding_attention"],
              "mlp_layer_types": ["moe", "moe"], "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["plugins", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    attention_lines = [line for line in out.splitlines() if line.startswith("make_attention ")]
    assert len(attention_lines) == 1
    assert "compress_rate=0" in attention_lines[0]
    assert "SamplingSpec(vocab_size=1000)" in out


def test_plugins_reports_a_missing_accelerator_plugin(isolated_plugin_manager, monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    assert cli.main(["plugins"]) == 1
    assert 'pip install "deepinfer[nvidia]"' in capsys.readouterr().err


def test_serve_subcommand_is_registered():
    parser = cli.build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"plugins", "serve"} <= set(subcommands)


def test_command_requires_a_subcommand(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


def test_module_runs_as_a_command():
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu"}
    result = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", "plugins"], capture_output=True, check=False,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("device: cpu")
    assert "reference" in result.stdout
