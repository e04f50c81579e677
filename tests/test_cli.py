"""The `deepinfer` command."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

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
    # the README's route: our plugin wheels are not on PyPI
    assert 'pip install --find-links dist "deepinfer[nvidia]"' in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_plugins_with_nvidia_forced_without_cuda_fails_before_printing_a_device(
        isolated_plugin_manager, monkeypatch, capsys):
    nvidia_hooks = pytest.importorskip("deepinfer_nvidia_sm100.hooks")
    isolated_plugin_manager.register(nvidia_hooks, name="nvidia_sm100")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    assert cli.main(["plugins"]) == 1
    captured = capsys.readouterr()
    assert "device:" not in captured.out
    assert "DEEPINFER_ACCELERATOR=nvidia but this machine cannot run 'cuda' devices" in captured.err


def test_representative_specs_follow_the_model_config():
    from deepinfer_core.backends import EplbSpec, SamplingSpec
    from deepinfer_core.config import ModelConfig

    config = ModelConfig(num_hidden_layers=3, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                           "heavily_compressed_attention"],
                         mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=8, vocab_size=100)
    specs = cli.representative_specs(config, torch.bfloat16)
    assert [(s.compress_rate, s.index_topk) for s in specs["make_attention"]] == [(0, 0), (4, 512), (128, 0)]
    assert all(s.dtype == torch.bfloat16 for s in specs["make_attention"] + specs["make_moe"])
    assert [s.is_hash for s in specs["make_moe"]] == [True, False]
    assert specs["make_eplb"] == [EplbSpec(num_layers=3, num_experts=8, num_slots=8)]
    assert specs["make_sampler"] == [SamplingSpec(vocab_size=100)]
    assert [(s.hidden_size, s.hc_mult, s.dtype) for s in specs["make_layer_ops"]] == [(4096, 4, torch.bfloat16)]
    assert specs["make_linear"] == []  # an unquantised checkpoint asks for no FP8 projection
    fp8 = ModelConfig.from_dict({**config.to_hf_dict(), "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}})
    linear = cli.representative_specs(fp8, torch.bfloat16)["make_linear"]
    assert linear and all((s.block, s.scale_format, s.weight_format) == ((32, 32), "ue8m0", "fp8") for s in linear)
    q_a = (config.hidden_size, config.q_lora_rank)
    assert q_a in {(s.in_features, s.out_features) for s in linear}
    assert any(s.groups == config.o_groups for s in linear)


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


HELP_IMPORTS = """
import sys
from deepinfer_core import cli
try:
    cli.main({argv!r})
except SystemExit:
    pass
print(sorted({{name.partition(".")[0] for name in sys.modules}} & {{"torch", "fastapi", "httpx", "uvicorn"}}))
"""


@pytest.mark.parametrize(("argv", "allowed"), [(["--help"], []), (["serve", "--help"], []),
                                                (["router", "--help"], [])])
def test_help_imports_no_torch(argv, allowed):
    # `deepinfer --help`, `serve --help` and `router --help` must answer at once (no torch, no server, no
    # HTTP client): what they import is checked, not how long they take
    result = subprocess.run([sys.executable, "-c", HELP_IMPORTS.format(argv=argv)], capture_output=True, text=True,
                            check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: deepinfer" in result.stdout
    assert result.stdout.splitlines()[-1] == str(allowed)


def test_router_without_httpx_says_what_to_install(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "deepinfer_core.entrypoints.router", raising=False)
    monkeypatch.setitem(sys.modules, "httpx", None)  # as if the pd extra were not installed
    with pytest.raises(SystemExit):  # its help needs no httpx
        cli.main(["router", "--help"])
    assert "--prefill" in capsys.readouterr().out
    assert cli.main(["router", "--prefill", "http://p:1", "--decode", "http://d:2"]) == 2  # running it does
    assert capsys.readouterr().err.strip() == ('deepinfer router is not available (httpx is not installed): '
                                               'pip install --find-links dist "deepinfer[pd]" (the wheels '
                                               '`nox -s wheels` builds; from a source checkout: pip install -e ".[pd]")')


def test_options_are_never_abbreviated(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plugins", "--mod", "/ckpt"])
    assert "unrecognized arguments: --mod" in capsys.readouterr().err


def test_config_errors_are_plain_sentences(capsys):
    from deepinfer_core.models.tiny import embedded_tiny_model_dir

    assert cli.main(["serve", str(embedded_tiny_model_dir()), "--max-num-seqs", "0"]) == 1
    err = capsys.readouterr().err
    assert err == "deepinfer serve: error: max_num_seqs: Input should be greater than 0\n"


def test_every_option_is_listed_in_the_docs():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    parser = cli.build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, subparser in subcommands.items():
        assert f"## `deepinfer {name}`" in page
        missing = [option for action in subparser._actions for option in action.option_strings
                   if option not in ("-h", "--help") and f"`{option}`" not in page]
        assert missing == [], f"docs/cli.md does not list deepinfer {name}'s {missing}"


def test_plugins_builds_no_engine(isolated_plugin_manager, monkeypatch, capsys):
    from deepinfer_core.engine import data_parallel, engine

    monkeypatch.setattr(engine, "Engine", lambda *a, **k: pytest.fail("an engine was built"))
    monkeypatch.setattr(data_parallel, "build_engine", lambda *a, **k: pytest.fail("an engine was built"))
    assert cli.main(["plugins"]) == 0
    assert "make_attention" in capsys.readouterr().out
