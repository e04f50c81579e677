"""The tiny models' greedy outputs, offline and served, equal those saved in outputs.json (written by
make_golden.py before the core's redesign): token ids and served text exactly, logprobs to 1e-5 (another
CPU may round the last bit differently; `python tests/golden/make_golden.py` checks bit for bit)."""

from __future__ import annotations

import json
import math

import pytest

from tests.golden import make_golden

SAVED = json.loads(make_golden.OUTPUTS.read_text())


def _close_logprobs(saved: list[str], now: list[str]) -> bool:
    return len(saved) == len(now) and all(
        math.isclose(float.fromhex(a), float.fromhex(b), rel_tol=0, abs_tol=1e-5) for a, b in zip(saved, now))


@pytest.mark.parametrize("name", list(make_golden.OFFLINE_CASES))
def test_offline_outputs_unchanged(name):
    family, options = make_golden.OFFLINE_CASES[name]
    outputs = make_golden.offline_case(family, options)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in SAVED[name]]
    assert all(_close_logprobs(s["logprobs"], o["logprobs"]) for s, o in zip(SAVED[name], outputs))


def _without_logprobs(choices: list[dict]) -> list[dict]:
    return [{key: value for key, value in choice.items() if key != "logprobs"} for choice in choices]


def test_served_outputs_unchanged():
    pytest.importorskip("deepinfer_recipe", reason="the HTTP server needs the recipe plugin")
    outputs = make_golden.served_case()
    assert [_without_logprobs(c) for c in outputs] == [_without_logprobs(c) for c in SAVED["served_v4"]]
    for saved, now in zip(SAVED["served_v4"], outputs):
        saved_lp = [item["logprob"] for item in ((saved[0].get("logprobs") or {}).get("content") or [])]
        now_lp = [item["logprob"] for item in ((now[0].get("logprobs") or {}).get("content") or [])]
        assert len(saved_lp) == len(now_lp) and all(abs(a - b) <= 1e-5 for a, b in zip(saved_lp, now_lp))
