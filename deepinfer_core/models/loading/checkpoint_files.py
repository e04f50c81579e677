"""Finding and opening a checkpoint's safetensors files; every failure names the file and what is wrong.

A checkpoint directory holds either `model.safetensors.index.json` (whose `weight_map` names each
tensor's shard) or one or more `*.safetensors` files. Errors are `CheckpointError`s that name the
file: an unreadable or malformed index, a shard that is missing or not a file, a file that is not
safetensors (garbage, truncated, a directory, a header that does not describe its bytes:
`safetensors_header`), a tensor stored in two files with no index to choose, a tensor whose bytes
cannot be read.
"""

from __future__ import annotations

import json
import math
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deepinfer_core.config import CheckpointError
from deepinfer_core.models.loading.safetensors_header import check_header
from deepinfer_core.models.loading.weight_digest import WeightDigest

_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}
"""Bytes per element of the safetensors dtypes wider than one byte."""
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
"""`owner/name`: how a Hugging Face hub id looks (a relative path of two parts may look the same)."""


def require_checkpoint_dir(model: str | Path) -> Path:
    """`model` as a checkpoint directory (one holding config.json), before anything is built from it.

    :raises CheckpointError: one sentence saying what `model` is instead: a hub id (nothing is downloaded
        here), a missing path, or a directory without config.json.
    """
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise CheckpointError(f"{model} is not a checkpoint directory: it has no config.json")
    if _HUB_ID.fullmatch(str(model)) and not path.parent.exists():
        raise CheckpointError(f"{model!r} looks like a Hugging Face hub id, but checkpoints are read from a local "
                              f"directory: download it first (huggingface-cli download {model} --local-dir DIR) "
                              f"and pass DIR")
    raise CheckpointError(f"{model}: no such checkpoint directory (one holding config.json and *.safetensors)")


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to its safetensors file."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir} is not a checkpoint directory")
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        return _indexed_files(index_path)
    single = model_dir / SINGLE_FILE
    paths = [single] if single.exists() else sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    files: dict[str, Path] = {}
    with ExitStack() as stack:
        for path in paths:
            names = open_safetensors(path, stack).keys()  # a safetensors handle is not iterable
            for name in names:
                if name in files:  # which copy would load depends on file order: refuse both
                    raise CheckpointError(f"tensor {name} is stored twice, in {files[name]} and {path}; without "
                                          f"{INDEX_FILE} naming one of them, the checkpoint is ambiguous")
                files[name] = path
    return files


def _indexed_files(index_path: Path) -> dict[str, Path]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{index_path} is not a readable JSON index: {err}") from err
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index_path} has no 'weight_map' object of tensor name -> shard file name")
    files = {name: index_path.parent / file for name, file in weight_map.items()}
    absent = sorted({str(path) for path in files.values() if not path.is_file()})
    if absent:
        raise CheckpointError(f"{index_path} names shard files that do not exist or are not files: {absent}")
    return files


def open_safetensors(path: Path, stack: ExitStack):
    """An open safetensors handle for `path`, closed with `stack`; `CheckpointError` if it is not one."""
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file (a safetensors weights file was expected there)")
    check_header(path)  # bounded, and every failure names the file and the tensor
    try:
        return stack.enter_context(safe_open(path, framework="pt"))
    except (OSError, SafetensorError) as err:
        raise CheckpointError(
            f"{path} is not a readable safetensors file (truncated or corrupt?): {err}"
        ) from err


class SafetensorsReader:
    """Open safetensors handles plus per-tensor metadata, read lazily; errors name the file.

    :param digest: a `WeightDigest` given every tensor's (or slice's) bytes as they are read (the weights
        part of the cache fingerprint, hashed without a second read of the files); None: not hashed.
    """

    def __init__(self, files: dict[str, Path], stack: ExitStack, digest: WeightDigest | None = None) -> None:
        self.digest = digest
        handles = {path: open_safetensors(path, stack) for path in set(files.values())}
        held = {path: set(handle.keys()) for path, handle in handles.items()}
        self._files = files
        self._handles = {name: handles[path] for name, path in files.items()}
        absent = sorted(name for name, path in files.items() if name not in held[path])
        if absent:
            raise CheckpointError(f"tensors the index places in files that do not hold them: {absent[:20]}")
        self.names = set(files)

    def dtype(self, name: str) -> str:
        """The tensor's safetensors header dtype ("BF16", "F8_E4M3", ...)."""
        return self._handles[name].get_slice(name).get_dtype()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        """The tensor's size in the file (FP8, packed FP4, I8 and E8M0: one byte an element)."""
        return math.prod(self.shape(name)) * _ITEMSIZE.get(self.dtype(name), 1)

    def read(self, name: str) -> torch.Tensor:
        try:
            tensor = self._handles[name].get_tensor(name)
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"{self._files[name]}: cannot read tensor {name}: {err}") from err
        if self.digest is not None:
            self.digest.add(name, tensor)
        return tensor

    def read_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Only the part `index` of the tensor (a tensor-parallel rank's slice): just those bytes are read."""
        try:
            tensor = self._handles[name].get_slice(name)[index]
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"{self._files[name]}: cannot read tensor {name}{list(index)}: {err}") from err
        if self.digest is not None:
            self.digest.add(f"{name}{index!r}", tensor)
        return tensor

    def scale_name(self, name: str) -> str | None:
        """The name of `name`'s quantisation scale in the checkpoint, or None."""
        base = name.removesuffix(".weight")
        candidates = (base + ".scale", name + "_scale_inv", name + ".scale")
        return next((c for c in candidates if c in self.names), None)
