"""Tensor parallelism for DeepSeek-V4.1: which of its tensors are cut, and why the rest are replicated.

V4.1's attention and MoE have V4's shapes under other names (`layers.N.attn.wq_b`, `layers.N.ffn.*`), so
they are cut by V4's rules (`tensor_parallel`): a rank owns `1/T` of the query heads, of the output
groups and of every expert's (routed and shared) intermediate width, and the attention and MoE blocks
each end in one all-reduce of their partial sums.

- column-parallel (output rows): `attn.wq_b` (the rank's query heads), `attn.wo_a` (the groups of exactly
  those heads), `attn.attn_sink`, the shared expert's `w1`/`w3`, the routed experts' gate and up rows;
- row-parallel (input columns, partial sums): `attn.wo_b`, the shared expert's `w2`, the routed
  experts' `down_proj`;
- replicated, each for a reason:
  - `wq_a`, `q_norm`: the low-rank query's norm needs the whole vector, and the indexers read it;
  - `wkv`, `kv_norm`: the one KV head every query head attends (the KV cache is whole on every rank);
  - the KV sources' `compressor` and index-key path (`indexer.wk`, `k_norm`): per-token, one head wide;
  - the two-level indexer (`indexer.wq_b`, `weights_proj`): its top-k needs every index head's scores,
    so cutting the heads would all-reduce `[tokens, entries]` scores per index source before the
    selection (and the candidate blocks' selection before that), larger than the work saved; each rank
    selects the same entries and blocks;
  - the router `gate.weight` with its `bias` and `bias_vl`: every rank routes every token to the same
    experts (text positions by `bias`, image positions by `bias_vl`), then runs its slice of each
    expert's width; cutting the router would need an all-gather of the scores before the top-k;
  - single-pass mHC (`hc_{attn,ffn}_{fn,base,scale}`) and the norms: they act on a token's whole
    residual streams, which every rank holds after each all-reduce;
  - Engram (`engram.wkv`, `q_weight`, `k_weight` and the tables `engram.embed.{weight,scale}`): its
    output is added to the whole streams before attention. The tables are replicated on every rank, in
    the placement `engram_placement` names (device, or pinned host memory): a lookup reads a few rows a
    token, so a rank holding all rows needs no communication, where a rank holding a row range would
    all-reduce its `[tokens, layers, heads x orders, head_dim]` lookups at every Engram layer. The cost
    is memory: the release's two tables (768M rows x 256 FP8 bytes + a UE8M0 scale per 32) are ~190 GiB
    per rank, so on one machine each rank process holds its own host copy; one shared copy per machine
    is not done yet;
  - `embed`, `head`, `norm`: whole on every rank, as in V4.
The DSpark (`mtp.*`) tensors are not loaded (DSpark is not run); the vision tower (`vision.*`, `aligner.*`,
`image_{start,newline,end}`) is replicated: every rank encodes the images of the requests it prefills.
"""

from __future__ import annotations

import re

V41_LAYER_NAME = re.compile(r"layers\.\d+\.(.+)")
"""A V4.1 decoder layer's tensor (internal names: the official ones, experts stacked as V4's)."""

COLUMN = 0
V41_PER_LAYER = {  # layers.N.<key> -> (dim, parts), as `tensor_parallel._PER_LAYER`
    "attn.wq_b.weight": (COLUMN, 1),
    "attn.wo_a.weight": (COLUMN, 1),
    "attn.attn_sink": (COLUMN, 1),
    "attn.wo_b.weight": (1, 1),
    "ffn.shared_experts.w1.weight": (COLUMN, 1),
    "ffn.shared_experts.w3.weight": (COLUMN, 1),
    "ffn.shared_experts.w2.weight": (1, 1),
    "ffn.experts.gate_up_proj": (1, 2),
    "ffn.experts.gate_up_proj_scale": (1, 2),
    "ffn.experts.down_proj": (2, 1),
    "ffn.experts.down_proj_scale": (2, 1),
}
