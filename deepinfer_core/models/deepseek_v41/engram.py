"""Engram: the n-gram hash memory DeepSeek-V4.1 adds to the residual streams at a few layers.

Per token, the compressed ids (`build_token_map`) of it and the 3 tokens before it are hashed into 24
rows of each Engram layer's table (2-, 3- and 4-grams x 8 heads); the rows are gathered
(`EngramTable.lookup`, the table on the device or in pinned host memory), projected to one key per
stream plus a shared value, and each stream adds the value scaled by a gate that measures how well
its key matches it (research-v41.md §4.2; DeepSeek's `inference/engram.py` and `model.py`).

Hash rules (pinned by tests/models/test_v41_engram.py):
- a look-back step before position 0, or at or behind a DEAD (image-span) position, gives the pad's id;
- multipliers: per Engram layer `l`, `numpy.random.default_rng(10007 * l).integers(0, bound, 4)` mapped
  to `2v + 1`, `bound = ((2**63 - 1) // compressed_vocab) // 2` (pinned in `PINNED_MULTIPLIERS`);
- the running XOR of `id[p - i] * m[i]` after i = 1, 2, 3 is the (i+1)-gram's hash; head h takes
  `hash % prime + offset`, primes the next unused primes above `engram_vocab_size - 1` in
  (layer, n-gram, head) order across all layers, offsets their running sum within the layer.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

DEAD = -1
"""A compressed id standing for an image-span position: it takes part in no n-gram."""
PINNED_MULTIPLIERS = {
    (1, 99092): (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    (14, 99092): (67716810739261, 51510806800915, 30921347202721, 82619226485591),
}
"""(layer, compressed vocab) -> the release's multipliers, as NumPy 2.x's PCG64 draws them; pinned
because NumPy does not promise its Generator streams across versions."""


def build_token_map(tokenizer) -> tuple[list[int], int]:
    """Every vocabulary id's compressed id, and how many there are, for a `tokenizers.Tokenizer`.

    Each id is decoded on its own (specials kept) and normalised (NFKC, NFD, accents stripped,
    lowercased, whitespace runs collapsed to one space, stripped; a token that is exactly one space
    stays a space; an empty result keeps the raw text; a decode with U+FFFD is keyed by its token
    string). Equal keys share an id, numbered by first appearance. The release gives 99,092.
    """
    from tokenizers import Regex, normalizers

    keep_space = "\ue000"  # a private-use character carries a lone space through Strip()
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep_space),
        normalizers.Strip(), normalizers.Replace(keep_space, " "),
    ])
    keys: dict[str, int] = {}
    token_map = []
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map.append(keys.setdefault(key, len(keys)))
    return token_map, len(keys)


def is_prime(n: int) -> bool:
    """Trial division (the primes here are ~1.6e7)."""
    if n < 4:
        return n >= 2
    if n % 2 == 0 or n % 3 == 0:
        return False
    d = 5
    while d * d <= n:
        if n % d == 0 or n % (d + 2) == 0:
            return False
        d += 6
    return True


def engram_primes(num_layers: int, num_orders: int, num_heads: int, start: int) -> list[list[list[int]]]:
    """`[layer][order][head]` primes: each the next prime above the last one handed out in its
    (layer, order) row, starting above `start - 1`, never reusing one (the used set spans all layers)."""
    used: set[int] = set()
    out = []
    for _ in range(num_layers):
        per_order = []
        for _ in range(num_orders):
            current, row = start - 1, []
            for _ in range(num_heads):
                current += 1
                while not is_prime(current) or current in used:
                    current += 1
                used.add(current)
                row.append(current)
            per_order.append(row)
        out.append(per_order)
    return out


def hash_multipliers(layer: int, max_ngram: int, compressed_vocab: int) -> tuple[int, ...]:
    """The layer's odd multipliers: pinned for the release, else drawn as the reference draws them."""
    pinned = PINNED_MULTIPLIERS.get((layer, compressed_vocab))
    if pinned is not None and len(pinned) == max_ngram:
        return pinned
    return draw_multipliers(layer, max_ngram, compressed_vocab)


def draw_multipliers(layer: int, max_ngram: int, compressed_vocab: int) -> tuple[int, ...]:
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    values = np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in values)


class EngramHasher:
    """Hash ids of every token for every Engram layer, from compressed ids and their look-back."""

    def __init__(self, config, token_map: list[int]) -> None:
        if len(token_map) != config.vocab_size:
            raise ValueError(f"the Engram token map has {len(token_map)} ids, the vocabulary {config.vocab_size}")
        num_compressed = max(token_map) + 1
        if num_compressed != config.engram_compressed_vocab_size:
            raise ValueError(f"the tokenizer compresses to {num_compressed} ids but engram_compressed_vocab_size is "
                             f"{config.engram_compressed_vocab_size}: this tokenizer does not belong to these weights")
        layers, n = config.engram_layer_ids, config.engram_max_ngram_size
        primes = engram_primes(len(layers), n - 1, config.engram_n_heads, config.engram_vocab_size)
        rows = [sum(sum(order) for order in layer) for layer in primes]
        if rows != list(config.engram_num_embeddings):
            raise ValueError(f"the prime rule gives table rows {rows}, engram_num_embeddings is "
                             f"{list(config.engram_num_embeddings)}")
        flat = torch.tensor([[p for order in layer for p in order] for layer in primes], dtype=torch.int64)
        self.max_ngram = n
        self.primes = flat  # [layers, (n - 1) * heads], column (order - 2) * heads + head
        self.offsets = torch.cumsum(flat, dim=1) - flat
        self.multipliers = torch.tensor([hash_multipliers(layer, n, num_compressed) for layer in layers])
        self.token_map = torch.tensor(token_map, dtype=torch.int64)
        self.pad_id = token_map[config.engram_pad_token_id]
        self.num_heads = config.engram_n_heads

    def to(self, device: torch.device) -> EngramHasher:
        for name in ("primes", "offsets", "multipliers", "token_map"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def hashes(self, lookback: torch.Tensor) -> torch.Tensor:
        """`lookback` `[T, max_ngram]` int64: compressed ids of p, p-1, ... (DEAD or -2 for before the
        start). Returns `[T, num_layers, (max_ngram - 1) * heads]` table rows."""
        blocked = torch.zeros_like(lookback[:, 0], dtype=torch.bool)
        ids = []
        for shift in range(self.max_ngram):
            blocked = blocked | (lookback[:, shift] < 0)
            ids.append(torch.where(blocked, self.pad_id, lookback[:, shift]))
        products = torch.stack(ids, dim=-1)[:, None, :] * self.multipliers  # [T, layers, n]
        rolling, out = products[..., 0], []
        heads = self.num_heads
        for i in range(1, self.max_ngram):
            rolling = torch.bitwise_xor(rolling, products[..., i])
            primes = self.primes[:, (i - 1) * heads : i * heads]
            out.append(rolling[..., None] % primes)
        return torch.cat(out, dim=-1) + self.offsets


ENGRAM_TABLE_SUFFIXES = ("engram.embed.weight", "engram.embed.scale")
"""How the names of an Engram layer's table (FP8 rows, UE8M0 scales: raw bytes) end."""


class EngramTable:
    """One Engram layer's FP8 rows and UE8M0 scales (raw bytes, uint8) behind `lookup`.

    `placement` "device" keeps the table where the model runs; "host" keeps it in host memory (pinned
    when CUDA is present): the release's two tables are ~190 GiB, more than a GPU holds. Host rows are
    read by the device itself when `reader` (layer ops that are a `HostRowGather`) is given, with no host
    step (`graph_safe`); else gathered on the host and only they are copied to the device."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, device: torch.device, placement: str = "device",
                 reader=None) -> None:
        if placement not in ("device", "host"):
            raise ValueError(f"Engram placement must be 'device' or 'host', got {placement!r}")
        self.device, self.placement = device, placement
        if placement == "host":  # loaded there already (`host_weight_names`): kept as they are
            from deepinfer_core.models.loading.weights import to_host

            weight, scale = to_host(weight), to_host(scale)
        self.weight, self.scale = weight, scale
        self.reader = reader if placement == "host" else None
        self.block = weight.shape[1] // scale.shape[1]

    @property
    def graph_safe(self) -> bool:
        """Whether a lookup reads no device value on the host (on the device, or host rows read by the device)."""
        return self.placement == "device" or self.reader is not None

    def raw_rows(self, ids: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 and UE8M0 bytes at device `ids`, read by the device (`reader`; into `out` if given)."""
        outs = out or (None, None)
        return tuple(self.reader.gather_host_rows(t, ids, o) for t, o in zip((self.weight, self.scale), outs))

    def lookup(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """Rows `[T, cols]` -> dequantised bf16 `[T, cols, dim]` on the model's device."""
        if self.reader is not None:
            return self.dequantise(*self.raw_rows(hash_ids.to(self.device)))
        ids = hash_ids.to(self.weight.device)
        return self.dequantise(self.weight[ids].to(self.device), self.scale[ids].to(self.device))

    def dequantise(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Gathered raw rows (`[..., cols]` FP8 bytes, `[..., cols // block]` UE8M0 bytes) -> bf16 rows,
        where they are (the host placement copies the raw bytes, half a bf16 row's, then dequantises)."""
        values, scales = values.view(torch.float8_e4m3fn).float(), scales.view(torch.float8_e8m0fnu).float()
        return (values.unflatten(-1, (-1, self.block)) * scales[..., None]).flatten(-2).to(torch.bfloat16)


def engram_gate(streams: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float,
                keep: torch.Tensor | None = None) -> torch.Tensor:
    """New streams: `X_s + g_s * value`, `g_s = sigmoid(signed sqrt(<X_s, w_s * key_s> * rsqrt(ms(X_s)) *
    rsqrt(ms(key_s)) / sqrt(D)))` in fp32 (`|.|` clamped at 1e-6); `kv` `[T, (n + 1) * D]` keys then value,
    `weight` `[n, D]` the product `q_weight * k_weight`; `keep` `[T]` False shuts the gate."""
    n, dim = streams.shape[1], streams.shape[2]
    key, value = kv.split([n * dim, dim], dim=-1)
    key, h = key.float().unflatten(-1, (n, dim)), streams.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight.float() * key).sum(-1) * rstd * dim**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if keep is not None:
        gate = gate.masked_fill(~keep[:, None], 0)
    return (h + gate[..., None] * value.float()[:, None, :]).to(streams.dtype)


def engram_forward(streams: torch.Tensor, rows: torch.Tensor, wkv: torch.Tensor | nn.Module, weight: torch.Tensor,
                   eps: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    """One Engram layer on its gathered `rows` `[T, cols, dim]` (`EngramTable.lookup`, or prefetched by
    `engram_prefetch`): project (`wkv` `[(n + 1) * D, cols * dim]`: the projection module, an `nn.Linear`
    or an `FP8Linear` kept in the checkpoint's FP8, or a dense weight), gate into the streams."""
    flat = rows.flatten(1)
    value = F.linear(flat.to(wkv.dtype), wkv) if isinstance(wkv, torch.Tensor) else wkv(flat.to(streams.dtype))
    return engram_gate(streams, value, weight, eps, keep)
