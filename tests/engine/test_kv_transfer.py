"""Prefill/decode disaggregation inside one process: a prefill engine exports a prompt's blocks, its
request state and its first token (`kv_transfer.export_prompt`), a decode engine reads them by NIXL (UCX
between two agents) and continues with no prompt token computed; its answer equals a single engine's."""

from __future__ import annotations

import os
import time

import pytest

from deepinfer_core.kv import nixl_transfer as kv_transfer
from deepinfer_core.sampling_params import SamplingParams
from tests.entrypoints.live import tiny_engine

pytest.importorskip("nixl_cu13._api", reason="prefill/decode disaggregation needs NIXL (the pd extra: nixl-cu13)")
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt) % 1000 + 5 for i in range(length)]


def run(engine, request_id: str, prompt: list[int], params: SamplingParams):
    engine.add_request(request_id, prompt, params)
    last = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            last = output
    return last


@pytest.fixture(scope="module")
def engines(request):
    small = {"max_num_seqs": 4, "max_num_batched_tokens": 64}
    built = {"prefill": tiny_engine(kv_transfer_role="prefill", host_cache_gib=0.01, **small),
             "decode": tiny_engine(kv_transfer_role="decode", **small), "single": tiny_engine(**small)}
    exporter = built["prefill"].prefix_tiers.exporter
    patch = pytest.MonkeyPatch()

    def fetch_handle(source, *_) -> dict:  # what GET /pd/handles/{id} answers
        handle = exporter.handle(source.id)
        if handle is None:
            raise kv_transfer.KvTransferError("HTTPStatusError: 404 Not Found")
        return handle

    patch.setattr(kv_transfer, "_fetch_handle", fetch_handle)
    yield built
    patch.undo()
    for engine in built.values():
        engine.shutdown()


def prefill(engines, request_id: str, prompt: list[int], params: SamplingParams) -> dict:
    """What the prefill instance's route does: run the prompt with the request's own parameters for one
    token, export; the `kv_transfer_params` the decode instance gets."""
    engine = engines["prefill"]
    out = run(engine, request_id, prompt, SamplingParams(**{**params_dict(params), "max_tokens": 1},
                                                         kv_transfer_params={"export": True}))
    first = out.outputs[0].token_ids[0]
    handle = kv_transfer.export_prompt(engine, prompt, request_id, first)
    assert handle["first_token"] == first and handle["state_bytes"] is not None
    return {"prefill": "in-process", "id": handle["id"], "first_token": first}


def params_dict(params: SamplingParams) -> dict:
    return {"max_tokens": params.max_tokens, "temperature": params.temperature, "seed": params.seed}


@pytest.mark.parametrize("length, params", [
    (300, SamplingParams(max_tokens=8, temperature=0)),  # a partial last block travels with the state
    (256, SamplingParams(max_tokens=6, temperature=1.0, seed=7)),  # whole blocks only; seeded sampling
])
def test_the_decode_engine_continues_from_the_prefill_state_with_no_prompt_token(engines, length, params):
    prompt = prompt_of(length)
    want = run(engines["single"], f"single-{length}", prompt, params)
    kv = prefill(engines, f"pd-{length}", prompt, params)
    decode = engines["decode"]
    before = decode.stats()
    got = run(decode, f"decode-{length}", prompt, SamplingParams(**params_dict(params), kv_transfer_params=kv))
    after = decode.stats()
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].text == want.outputs[0].text
    assert got.num_cached_tokens == length
    assert after["num_prefill_tokens"] == before["num_prefill_tokens"]  # not one prompt token computed
    assert after["prefix_cache_replay_tokens"] == before["prefix_cache_replay_tokens"]
    assert after["kv_transfer_states_in"] == before["kv_transfer_states_in"] + 1
    assert after["num_decode_tokens"] - before["num_decode_tokens"] == params.max_tokens - 1  # the first came along
    exporter = engines["prefill"].prefix_tiers.exporter
    for _ in range(500):  # the read's notification arrives on its own
        exporter.release_done()
        if not exporter.num_pending:
            break
        time.sleep(0.01)
    assert exporter.num_pending == 0  # released once read


def test_a_lost_prefill_instance_leaves_the_decode_engine_computing_the_prompt(engines):
    prompt, params = prompt_of(200, salt=1), SamplingParams(max_tokens=5, temperature=0)  # nothing cached
    want = run(engines["single"], "single-lost", prompt, params)
    first = want.outputs[0].token_ids[0]
    decode = engines["decode"]
    before = decode.stats()
    kv = {"prefill": "in-process", "id": "gone", "first_token": first}  # no such export any more
    got = run(decode, "decode-lost", prompt, SamplingParams(max_tokens=5, temperature=0, kv_transfer_params=kv))
    after = decode.stats()
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert after["kv_transfer_failures"] == before["kv_transfer_failures"] + 1
    assert after["num_prefill_tokens"] - before["num_prefill_tokens"] == len(prompt) + 1  # prompt and first token


def test_a_first_token_is_refused_where_it_cannot_be_continued(engines):
    kv = {"prefill": "in-process", "id": "x", "first_token": 5}
    with pytest.raises(ValueError, match="only for n=1"):
        engines["decode"].add_request("n2", prompt_of(10), SamplingParams(n=2, kv_transfer_params=kv))
    with pytest.raises(ValueError, match="first_token must be a token id"):
        engines["decode"].add_request("bad", prompt_of(10), SamplingParams(kv_transfer_params={**kv, "first_token": -1}))
    assert not engines["decode"].has_unfinished_requests()
