"""Corrupt safetensors files: refused at load with one error naming the file and the tensor (issue 43 item 7)."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch

from deepinfer_core.config import CheckpointError, EngineConfig, ModelConfig
from deepinfer_core.models.loading.weights import load_weights
from deepinfer_core.testing.checkpoints import random_state_dict, tiny_config, write_checkpoint
from deepinfer_core.worker.model_loader import load_model

CONFIG = tiny_config()


@pytest.fixture(scope="module")
def weights():
    return random_state_dict(CONFIG, seed=3)


def split(path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join(path, header: dict, data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def by_offset(header: dict) -> list[str]:
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])


def load(directory):
    return load_weights(directory, ModelConfig.from_dir(directory))


def test_a_huge_header_length_is_one_clear_error_naming_the_file(tmp_path, weights):
    """Through the engine's loader, which used to read that many bytes for the fingerprint (an empty MemoryError)."""
    write_checkpoint(tmp_path, CONFIG, weights)
    path = tmp_path / "model.safetensors"
    header, data = split(path)
    join(path, header, data, length=2**62)
    config = ModelConfig.from_dir(tmp_path)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))} .*header length {2**62} exceeds"):
        load_model(config, EngineConfig(model=str(tmp_path), device="cpu", dtype="float32"), torch.device("cpu"))


def corrupt(header: dict, data: bytes, damage: str) -> tuple[dict, bytes, str]:
    """`(header, data, tensor the error must name)` of one kind of damage."""
    names = by_offset(header)
    last = names[-1]
    if damage == "truncated data":
        return header, data[:-3], last
    if damage == "offset past the end":
        header[last]["data_offsets"][1] += 4
        return header, data, last
    if damage == "overlapping offsets":  # two tensors of one size: the second made to read the first's bytes
        sizes = {}
        for name in names:
            begin, end = header[name]["data_offsets"]
            if end - begin in sizes:
                header[name]["data_offsets"] = list(header[sizes[end - begin]]["data_offsets"])
                return header, data, name
            sizes[end - begin] = name
        raise AssertionError("no two tensors of one size")
    if damage == "dtype vs bytes":
        name = next(n for n in names if header[n]["dtype"] == "F32")
        header[name]["dtype"] = "F16"
        return header, data, name
    if damage == "shape vs bytes":
        name = next(n for n in names if header[n]["shape"])
        header[name]["shape"][0] += 1
        return header, data, name
    raise ValueError(damage)


@pytest.mark.parametrize("damage", ["truncated data", "offset past the end", "overlapping offsets", "dtype vs bytes",
                                    "shape vs bytes"])
def test_a_header_that_does_not_describe_its_bytes_names_the_file_and_tensor(tmp_path, weights, damage):
    write_checkpoint(tmp_path, CONFIG, weights)
    path = tmp_path / "model.safetensors"
    header, data, name = corrupt(*split(path), damage)
    join(path, header, data)
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as err:
        load(tmp_path)
    assert re.search(rf"\b{re.escape(name)}\b", str(err.value)), str(err.value)


def test_a_tensor_stored_in_two_shards_without_an_index_is_refused(tmp_path, weights):
    """Which copy loaded depended on the order the files were opened in: different weights, silently."""
    write_checkpoint(tmp_path, CONFIG, weights, shards=2)
    (tmp_path / "model.safetensors.index.json").unlink()
    first, second = sorted(tmp_path.glob("*.safetensors"))
    header, _ = split(first)
    name = by_offset(header)[0]
    begin, end = header[name]["data_offsets"]
    other, other_data = split(second)
    other[name] = {**header[name], "data_offsets": [len(other_data), len(other_data) + end - begin]}
    join(second, other, other_data + bytes(end - begin))  # the same tensor, all zeros, in the second shard
    with pytest.raises(CheckpointError, match=rf"tensor {re.escape(name)} is stored twice, in .*{first.name} and "
                                              rf".*{second.name}"):
        load(tmp_path)
