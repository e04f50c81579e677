"""Loading a DeepSeek-V4.1 checkpoint in the official layout into `DeepseekV41ForCausalLM`'s names.

Every tensor on disk is checked against `v41_release.released_tensors(config)` (name, dtype, shape)
before any is read; missing, unexpected, misshaped and mistyped tensors raise one `CheckpointError`
naming all of them. DSpark (`mtp.*`) tensors are skipped and reported (the text model does not run them; the DSpark drafter reads `mtp.*` itself, `dspark_weights`); the vision
tower's (`vision.*`, `aligner.*`, `image_{start,newline,end}`, all BF16) are read in their stored dtype
when the config has a tower (`vision.VisionConfig.of`; then they are required), else skipped and
reported. They are replicated under tensor and expert parallelism (`vision.py`). FP8 weights (e4m3 with UE8M0 scales per `weight_block_size`, 32x32 in the release) are
dequantised to the compute dtype, except the projections named in `keep_fp8` (`quantized_weights="native"`,
as V4's loader keeps them: `<name>` float8_e4m3fn, `<name>_scale` the block scales as float32, exact for
UE8M0; `layers.FP8Linear`'s parameters); FP4 experts are dequantised too, or kept packed (`keep_fp4`); the
Engram tables stay in their FP8 bytes. The Engram token map is built from the checkpoint's own
`tokenizer.json`. A config or tokenizer that differs from the release is reported (logged) at load.

Under tensor parallelism (`shards`, `tensor_parallel.tensor_shards` of the rank) only the rank's slices
of the cut tensors are read: FP8 projections in whole scale blocks where the cut falls on block edges
(else read whole and cut after dequantising), dequantised even when named in `keep_fp8` (as V4's cut
projections are), FP4 experts as their packed bytes and scales.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection
from contextlib import ExitStack
from pathlib import Path

import torch

from deepinfer_core.backends import quant
from deepinfer_core.config import CheckpointError
from deepinfer_core.models import tensor_parallel
from deepinfer_core.models.deepseek_v41.engram import ENGRAM_TABLE_SUFFIXES
from deepinfer_core.models.deepseek_v41.release import (
    is_skipped,
    is_vision,
    release_differences,
    released_tensors,
)
from deepinfer_core.models.deepseek_v41.vision import VisionConfig
from deepinfer_core.models.loading.checkpoint_files import SafetensorsReader, checkpoint_files
from deepinfer_core.models.loading.weights import to_host
from deepinfer_core.models.tensor_parallel import Shard

logger = logging.getLogger(__name__)
_PLAIN_FLOATS = {"BF16": ("BF16", "F32"), "F32": ("F32",)}
"""Stored dtype the release uses -> what a checkpoint may store instead (F32 holds BF16 exactly)."""


def load_v41_checkpoint(model_dir, config, dtype: torch.dtype, device, keep_fp4: bool = False,
                        host: Collection[str] = (), shards: dict[str, Shard] | None = None,
                        local_experts: Callable[[int], list[int]] | None = None,
                        digest=None, keep_fp8: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """The model's weights (its own names) from `model_dir`, checked, dequantised, on `device`; those
    named in `host` (the Engram tables placed in host memory) are read into host memory instead; the
    FP8 projections named in `keep_fp8` (`weight_formats.fp8_projection_names`) and not cut stay FP8
    (`<name>_scale` float32 beside them). With
    `shards` (a tensor-parallel rank's, by internal name) only those slices of the cut tensors are read;
    with `local_experts` (layer -> the expert of each of an expert-parallel rank's slots) only those
    routed experts, stacked in slot order; `digest` (a `WeightDigest`) is given the bytes read."""
    shards = shards or {}
    model_dir = Path(model_dir)
    differences = release_differences(model_dir, config)
    if differences:
        # one line (a tiny test model differs in dozens of values); the whole list at DEBUG
        logger.warning("%s differs from the DeepSeek-V4.1-Flash release in %d values (first: %s; the rest at DEBUG "
                       "level of %s)", model_dir, len(differences), differences[0].strip(), __name__)
        logger.debug("%s differs from the DeepSeek-V4.1-Flash release:\n%s", model_dir, "\n".join(differences))
    expected = {t.name: t for t in released_tensors(config)}
    has_vision = VisionConfig.of(config) is not None
    with ExitStack() as stack:
        reader = SafetensorsReader(checkpoint_files(model_dir), stack, digest)
        check_tensors(reader, expected, model_dir, has_vision)
        weights = {}
        for name, tensor in expected.items():
            is_scale = name.endswith(".scale") and not name.endswith(ENGRAM_TABLE_SUFFIXES)
            if is_skipped(name, has_vision) or is_scale or ".experts." in name:
                continue
            if name in keep_fp8 and tensor.dtype == "F8_E4M3" and name not in shards:
                weights.update({key: value.to(device) for key, value in _read_fp8(reader, name).items()})
                continue
            value = _read(reader, name, tensor.dtype, config, dtype, shards.get(name))
            weights[name] = to_host(value) if name in host else value.to(device)
        for layer in range(config.num_hidden_layers):
            experts = local_experts(layer) if local_experts is not None else range(config.n_routed_experts)
            weights.update(_experts(reader, config, layer, experts, dtype, device, keep_fp4, shards))
    if config.engram_layer_ids:
        weights["engram_token_map"] = torch.tensor(token_map(model_dir / "tokenizer.json"), dtype=torch.long)
    return weights


def check_tensors(reader: SafetensorsReader, expected: dict, model_dir: Path, has_vision: bool = False) -> None:
    """Raise one `CheckpointError` for every missing, unexpected, misshaped or mistyped tensor; log
    the skipped DSpark tensors, and the vision tensors unless `has_vision` (then they are loaded)."""
    on_disk = reader.names
    skipped = sorted(n for n in on_disk if is_skipped(n, has_vision))
    if skipped:
        vision = sum(is_vision(n) for n in skipped)
        logger.info("%s: skipping %d DSpark (mtp.*) tensors%s: the text model does not run them "
                    "(speculative_config method 'dspark' reads mtp.*)", model_dir,
                    len(skipped) - vision, f" and {vision} vision tensors (its config has no vision tower)" if vision else "")
    missing = sorted(n for n in expected if n not in on_disk and not is_skipped(n, has_vision))
    unexpected = sorted(n for n in on_disk if n not in expected and not is_skipped(n, has_vision))
    wrong = []
    for name in sorted(set(expected) & on_disk):
        want, shape, stored = expected[name], reader.shape(name), reader.dtype(name)
        if shape != want.shape:
            wrong.append(f"{name} has shape {list(shape)}, expected {list(want.shape)}")
        if stored not in _PLAIN_FLOATS.get(want.dtype, (want.dtype,)):
            wrong.append(f"{name} is stored as {stored}, expected {want.dtype}")
    if missing or unexpected or wrong:
        parts = [f"missing tensors: {missing[:20]}" + (f" (+{len(missing) - 20})" if len(missing) > 20 else "")] if missing else []
        parts += [f"unexpected tensors: {unexpected[:20]}"] if unexpected else []
        parts += wrong[:20]
        raise CheckpointError(f"{model_dir} is not a DeepSeek-V4.1 checkpoint for its config.json: " + "; ".join(parts))


def _read(reader: SafetensorsReader, name: str, stored: str, config, dtype: torch.dtype,
          shard: Shard | None = None) -> torch.Tensor:
    if shard is not None:  # a cut projection, sink or shared expert: only the rank's slices
        if stored == "F8_E4M3":
            return tensor_parallel.read_fp8_slices(reader, name, shard, config.fp8_block, "cpu").to(dtype)
        return tensor_parallel.read_slices(reader, name, shard, "cpu")
    tensor = reader.read(name)
    if name.endswith(ENGRAM_TABLE_SUFFIXES):
        return tensor.view(torch.uint8)  # the table stays in its own bytes
    if stored == "F8_E4M3":
        scale = reader.read(name.removesuffix(".weight") + ".scale")
        return quant.dequantize_fp8(tensor, scale, config.fp8_block).to(dtype)
    return tensor


def _read_fp8(reader: SafetensorsReader, name: str) -> dict[str, torch.Tensor]:
    """FP8 projection weight `name` as stored (float8_e4m3fn) and its block scales as float32
    (`<name>_scale`), what `layers.FP8Linear` holds."""
    scale = reader.read(name.removesuffix(".weight") + ".scale")
    return {name: reader.read(name), f"{name}_scale": scale.to(torch.float32)}


def _experts(reader, config, layer: int, experts, dtype, device, keep_fp4: bool,
             shards: dict[str, Shard], block: str = "layers") -> dict[str, torch.Tensor]:
    """One layer's routed `experts` stacked as `ffn.experts.gate_up_proj` / `down_proj` (+ `_scale`
    packed); a rank's `shards` cut each expert's w1 and w3 rows and w2 columns (each source is one part).
    `block` "mtp": DSpark stage `layer`'s experts."""
    prefix, out = f"{block}.{layer}.ffn.experts.", {}
    for target, parts in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
        shard = shards.get(prefix + target)
        source_shard = shard.source_shard("stack_pairs") if shard is not None else None
        values, scales = [], []
        for e in experts:
            read = [_expert(reader, f"{prefix}{e}.{p}", config, dtype, keep_fp4, source_shard) for p in parts]
            values.append(torch.cat([value for value, _ in read]))
            if keep_fp4 and config.expert_dtype == "fp4":
                scales.append(torch.cat([scale for _, scale in read]))
        out[prefix + target] = torch.stack(values).to(device)
        if scales:
            out[prefix + target + "_scale"] = torch.stack(scales).to(device)
    return out


def _expert(reader, name: str, config, dtype, keep_fp4: bool, shard: Shard | None):
    """One expert projection `name` (w1, w2 or w3): packed FP4 codes and scales when kept, else its
    dequantised weight and None; only `shard`'s slices when given (FP4 as bytes, FP8 in scale blocks)."""
    weight, scale = name + ".weight", name + ".scale"
    if config.expert_dtype != "fp4":
        if shard is not None:
            return tensor_parallel.read_fp8_slices(reader, weight, shard, config.fp8_block, "cpu").to(dtype), None
        return quant.dequantize_fp8(reader.read(weight), reader.read(scale), config.fp8_block).to(dtype), None
    if shard is None:
        codes, scales = reader.read(weight), reader.read(scale)
    else:  # w2 is cut along its packed, grouped input dim: two codes a byte, one scale per 32
        is_input_dim = shard.dim == len(reader.shape(weight)) - 1
        codes = tensor_parallel.read_slices(reader, weight, shard, "cpu", 2 if is_input_dim else 1)
        scales = tensor_parallel.read_slices(reader, scale, shard, "cpu", quant.FP4_GROUP_SIZE if is_input_dim else 1)
    if keep_fp4:
        return codes, scales
    return quant.dequantize_fp4(codes, scales).to(dtype), None


def token_map(tokenizer_file: Path) -> list[int]:
    """The Engram compressed token map of a checkpoint's `tokenizer.json` (cached per file version)."""
    if not tokenizer_file.is_file():
        raise CheckpointError(f"{tokenizer_file} not found: Engram's token map is built from the checkpoint's tokenizer")
    stat = tokenizer_file.stat()
    return list(_token_map(str(tokenizer_file), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _token_map(path: str, size: int, mtime: int) -> tuple[int, ...]:
    from tokenizers import Tokenizer

    from deepinfer_core.models.deepseek_v41.engram import build_token_map

    return tuple(build_token_map(Tokenizer.from_file(path))[0])
