"""One reader for the checkpoint's JSON files, and one loader for the packages' lazy exports: each place
that reads a config file, or exports names on first use, goes through it (and answers alike)."""

from __future__ import annotations

import json

import pytest

import deepinfer_core
from deepinfer_core import backends
from deepinfer_core.config import ConfigError, read_config_json
from deepinfer_core.config.eos import with_checkpoint_eos
from deepinfer_core.entrypoints.sizing import read_model_config


def _config_json(directory):
    return read_config_json(directory)


def _generation_config(directory):
    return with_checkpoint_eos({"eos_token_id": 1}, directory)


def _plan_config(directory):
    return read_model_config(directory / "config.json")


@pytest.mark.parametrize(("reader", "name"), [(_config_json, "config.json"),
                                              (_generation_config, "generation_config.json"),
                                              (_plan_config, "config.json")])
@pytest.mark.parametrize(("content", "message"), [("[1, 2]", "must hold a JSON object, got list"),
                                                  ("{not json", "is not valid JSON: ")])
def test_every_config_file_reader_answers_alike(tmp_path, reader, name, content, message) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError) as caught:
        reader(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / name} {message}")


@pytest.mark.parametrize("package", [deepinfer_core, backends])
def test_both_packages_export_through_the_one_lazy_loader(package) -> None:
    assert package.__getattr__.__module__ == "deepinfer_core.lazy_exports"
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match=rf"module '{package.__name__}' has no attribute 'nothing_here'"):
        package.nothing_here  # noqa: B018
    name = package.__all__[0]
    assert getattr(package, name) is vars(package)[name]  # loaded once, then a plain attribute
