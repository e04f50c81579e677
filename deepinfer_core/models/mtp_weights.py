"""Reading the MTP layer's tensors (`mtp.*`) from a checkpoint, in any of the three layouts.

- "hf" (internal names): `mtp.0.self_attn.q_a_proj.weight`, `mtp.0.enorm.weight`, ...
- "official" (DeepSeek's release): the per-layer names of `checkpoint_layout` under `mtp.0.`
  (`mtp.0.attn.wq_a.weight`, `mtp.0.ffn.experts.E.w1.weight`, ...) plus `mtp.0.enorm.weight`,
  `mtp.0.hnorm.weight`, `mtp.0.e_proj.weight`, `mtp.0.h_proj.weight`, `mtp.0.hc_head_fn` / `_base` /
  `_scale` and `mtp.0.norm.weight`;
- "transformers": the official names under `model.` (its `kv_norm` spelled `norm`, as for the layers).
Quantised MTP tensors (FP8 / FP4) are not read yet: a clear `NotImplementedError` names them.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import torch

from deepinfer_core.config import CheckpointError
from deepinfer_core.models import checkpoint_layout as layout
from deepinfer_core.models.checkpoint_files import checkpoint_files, open_safetensors

_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "e_proj.weight": "e_proj.weight",
            "h_proj.weight": "h_proj.weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn",
            "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
"""Official MTP-only names (after `mtp.<i>.`) -> internal."""
_OFFICIAL_TO_INTERNAL = {official: internal for internal, official in layout._PER_LAYER.items()}
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
_NAME = re.compile(r"(?:model\.)?mtp\.(\d+)\.(.+)")


def read_mtp_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every `mtp.*` tensor of the checkpoint, by its on-disk name (empty when it has none, or no
    safetensors file at all)."""
    if not any(Path(model_dir).glob("*.safetensors")) and not any(Path(model_dir).glob("*.safetensors.index.json")):
        return {}
    files = checkpoint_files(model_dir)
    names = [n for n in files if n.startswith(("mtp.", "model.mtp."))]
    tensors = {}
    with ExitStack() as stack:
        handles = {}
        for name in names:
            path = files[name]
            if path not in handles:
                handles[path] = open_safetensors(path, stack)
            tensors[name] = handles[path].get_tensor(name)
    return tensors


def to_internal(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """On-disk MTP tensors -> internal names without the `mtp.` prefix (`0.self_attn.q_a_proj.weight`).

    :raises NotImplementedError: quantised tensors (named).
    :raises CheckpointError: a name none of the layouts has.
    """
    quantised = sorted(n for n, t in tensors.items() if not t.dtype.is_floating_point or t.element_size() == 1)
    if quantised:
        raise NotImplementedError(f"quantised MTP tensors ({quantised[:3]}): load a checkpoint whose mtp.* "
                                  "weights are stored in a float dtype")
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _NAME.fullmatch(name)
        if match is None:
            raise CheckpointError(f"unexpected MTP tensor name {name!r}")
        index, key = match.groups()
        key = re.sub(r"^attn\.norm\.weight$", "attn.kv_norm.weight", key) if name.startswith("model.") else key
        if (expert := _EXPERT.fullmatch(key)) is not None:
            experts.setdefault((index, expert.group(2)), {})[int(expert.group(1))] = tensor
        elif key in _MTP_OWN:
            out[f"{index}.{_MTP_OWN[key]}"] = tensor
        elif key in _OFFICIAL_TO_INTERNAL:
            out[f"{index}.{_OFFICIAL_TO_INTERNAL[key]}"] = tensor
        else:
            out[f"{index}.{key}"] = tensor  # already an internal name ("hf" layout)
    for (index, part), by_expert in experts.items():
        experts[(index, part)] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    for index in {i for i, _ in experts}:
        if (index, "w1") in experts:
            out[f"{index}.mlp.experts.gate_up_proj"] = torch.cat([experts[(index, "w1")], experts[(index, "w3")]], 1)
        if (index, "w2") in experts:
            out[f"{index}.mlp.experts.down_proj"] = experts[(index, "w2")]
    return out
