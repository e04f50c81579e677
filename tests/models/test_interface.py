"""The cache fingerprint: what cached blocks depend on besides their tokens, the weights' bytes included."""

from __future__ import annotations

import struct

import torch

from deepinfer_core.config import ModelConfig
from deepinfer_core.models.interface import cache_fingerprint
from deepinfer_core.models.layer_plan import build_layer_plan
from deepinfer_core.models.loading.weight_digest import WeightDigest, tensors_digest
from deepinfer_core.models.loading.weights import load_weights
from deepinfer_core.models.tiny import random_state_dict, tiny_config, write_checkpoint


def fingerprint(config: dict, identity: bytes, dtype=torch.float32) -> bytes:
    model_config = ModelConfig.from_dict(config)
    return cache_fingerprint(model_config, dtype, build_layer_plan(model_config, dtype), identity)


def read_identity(model_dir, config: dict) -> bytes:
    """The weights' digest taken while the loader reads the checkpoint (as `load_model` takes it)."""
    digest = WeightDigest()
    load_weights(model_dir, ModelConfig.from_dict(config), digest=digest)
    return digest.digest()


def headers(model_dir) -> list[bytes]:
    """Every safetensors file's name, size and header: all the old fingerprint looked at."""
    out = []
    for path in sorted(model_dir.glob("*.safetensors")):
        raw = path.read_bytes()
        out.append(path.name.encode() + str(len(raw)).encode() + raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    return out


def scaled(weights: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {name: t * factor if t.is_floating_point() else t for name, t in weights.items()}


def test_rewritten_weights_under_identical_headers_change_the_fingerprint(tmp_path):
    config = tiny_config()
    weights = random_state_dict(config, seed=1)
    a = write_checkpoint(tmp_path / "a", config, weights)
    again = write_checkpoint(tmp_path / "again", config, weights)
    b = write_checkpoint(tmp_path / "b", config, scaled(weights, 1.05))  # checkpoint B: A's weights x 1.05
    assert headers(a) == headers(b)  # names, sizes, dtypes, shapes and offsets all alike
    base = fingerprint(config, read_identity(a, config))
    assert base == fingerprint(config, read_identity(again, config))
    assert base != fingerprint(config, read_identity(b, config))  # rewritten weights
    assert base != fingerprint(config, read_identity(a, config), torch.bfloat16)  # another compute dtype
    assert base != fingerprint({**config, "sliding_window": config["sliding_window"] // 2}, read_identity(a, config))


def test_one_changed_value_anywhere_changes_the_digest(tmp_path):
    config = tiny_config()
    weights = random_state_dict(config, seed=1)
    name = max(weights, key=lambda n: weights[n].numel())  # the largest tensor: hashed on the threads
    changed = {**weights, name: weights[name].clone()}
    changed[name].view(-1)[-1] += 1.0
    a = write_checkpoint(tmp_path / "a", config, weights)
    b = write_checkpoint(tmp_path / "b", config, changed)
    assert headers(a) == headers(b)
    assert read_identity(a, config) != read_identity(b, config)


def test_the_digest_does_not_depend_on_read_order_and_counts_each_tensor_once():
    weights = random_state_dict(tiny_config(), seed=3)
    forward, backward = WeightDigest(), WeightDigest(num_threads=1)
    for name in weights:
        forward.add(name, weights[name])
    for name in reversed(list(weights)):
        backward.add(name, weights[name])
        backward.add(name, weights[name])  # read twice (a tied embedding): the same bytes
    assert forward.digest() == backward.digest()
    assert forward.num_bytes == backward.num_bytes == sum(t.numel() * t.element_size() for t in weights.values())


def test_in_memory_weights_are_told_apart_by_every_value():
    config = tiny_config()
    one, two = random_state_dict(config, seed=1), random_state_dict(config, seed=2)
    assert tensors_digest(one) == tensors_digest(random_state_dict(config, seed=1))
    assert tensors_digest(one) != tensors_digest(two)
    name = max(one, key=lambda n: one[n].numel())
    late = {**one, name: one[name].clone()}
    late[name].view(-1)[-1] += 1.0  # past the first values, which were all the old identity read
    assert tensors_digest(one) != tensors_digest(late)
    assert tensors_digest(one) != tensors_digest({**one, name: one[name].to(torch.bfloat16)})
