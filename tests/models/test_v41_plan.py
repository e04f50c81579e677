"""The released V4.1 config's layer plan equals research-v41.md §3's table."""

from __future__ import annotations

import torch

from deepinfer_core.models.deepseek_v41.config import V41Config
from deepinfer_core.models.deepseek_v41.plan import build_v41_plan
from deepinfer_core.models.v41_tiny import tiny_v41_config
from tests.models.test_v41_config import RELEASE

# layers -> (ratio, role, kv source, index source); research-v41.md §3
TABLE = {
    (0, 1): (0, "window", None, None),
    (2,): (2, "full", None, 2), (8,): (2, "full", None, 8), (14,): (2, "full", None, 14),
    (3, 4, 5, 6, 7): (2, "reuse", 2, 2), (9, 10, 11, 12, 13): (2, "reuse", 8, 8),
    (15, 16, 17, 18, 19): (2, "reuse", 14, 14),
    (20,): (1, "full", None, 20),
    (24,): (1, "reindex", 20, 24), (28,): (1, "reindex", 20, 28), (32,): (1, "reindex", 20, 32), (36,): (1, "reindex", 20, 36),
    (21, 22, 23): (1, "reuse", 20, 20), (25, 26, 27): (1, "reuse", 20, 24), (29, 30, 31): (1, "reuse", 20, 28),
    (33, 34, 35): (1, "reuse", 20, 32), (37, 38, 39): (1, "reuse", 20, 36),
}


def test_the_released_plan_equals_the_spec_table():
    plans = build_v41_plan(V41Config.from_dict(RELEASE), torch.bfloat16)
    assert len(plans) == 40 and sum(len(layers) for layers in TABLE) == 40
    for layers, (ratio, role, kv, index) in TABLE.items():
        for layer in layers:
            plan = plans[layer]
            assert (plan.ratio, plan.role, plan.kv_source, plan.index_source) == (ratio, role, kv, index), layer
            assert plan.rope == ("main" if ratio == 0 else "compress")
    assert [p.index for p in plans if p.is_candidate_source] == [20]
    assert [p.index for p in plans if p.uses_candidates] == [24, 28, 32, 36]
    assert [p.index for p in plans if p.has_engram] == [1, 14] and [p.index for p in plans if p.owns_token_ids] == [1]
    assert [p.index for p in plans if p.owns_compressed] == [2, 8, 14, 20]
    # ratio 1 never has an open group; ratio 2's ring holds any verification step's positions (k <= 16)
    assert [p.tail_rows for p in plans if p.owns_compressed] == [17, 17, 17, 0]


def test_the_compressed_rope_is_yarn_on_160000_and_the_window_rope_is_plain():
    config = V41Config.from_dict(RELEASE)
    assert config.rope(0) == {"rope_type": "default", "rope_theta": 10000.0}
    compressed = config.rope(1)
    assert compressed["rope_type"] == "yarn" and compressed["rope_theta"] == 160000.0
    assert compressed["factor"] == 16 and compressed["original_max_position_embeddings"] == 65536
    assert compressed["attention_factor"] == 1.0  # the reference does not scale cos/sin


def test_the_tiny_model_has_every_role():
    plans = build_v41_plan(V41Config.from_dict(tiny_v41_config()), torch.float32)
    roles = [(p.ratio, p.role) for p in plans]
    assert roles == [(0, "window"), (0, "window"), (2, "full"), (2, "reuse"), (2, "full"), (1, "full"),
                     (1, "reuse"), (1, "reindex"), (1, "reuse")]
    assert plans[8].index_source == 7 and plans[8].kv_source == 5 and plans[7].uses_candidates
