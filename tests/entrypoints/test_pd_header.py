"""The decode instance's `kv_transfer_params` header (`entrypoints.pd.kv_transfer_of`): parsed once, into
the typed handle, with the wire JSON unchanged; a malformed one is a 400 that says what is wrong; only a
handle the router signed, naming a configured prefill instance, is ever used (else it is counted and
the prompt is computed). (The PD end-to-end tests in test_pd.py need NIXL; these do not.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from deepinfer_core.chat_contract import ApiError
from deepinfer_core.entrypoints.auth import InstanceKey
from deepinfer_core.entrypoints.metrics import ServerMetrics
from deepinfer_core.entrypoints.pd import (
    KV_TRANSFER_HEADER,
    KV_TRANSFER_SIGNATURE_HEADER,
    KvTransferGate,
    kv_transfer_of,
    sign_kv_transfer,
)
from deepinfer_core.kv.pd_handle import normalized_url
from deepinfer_core.sampling_params import KvTransferParams

KEY = InstanceKey(b"shared by the router and its instances")


def decode_app(metrics: ServerMetrics | None = None) -> SimpleNamespace:
    """What `kv_transfer_of` reads of a decode instance's app: its gate, trusting one prefill instance."""
    metrics = metrics or ServerMetrics()
    gate = KvTransferGate(KEY, frozenset({normalized_url("http://prefill:8000")}), metrics)
    return SimpleNamespace(state=SimpleNamespace(kv_transfer_gate=gate, server=SimpleNamespace(metrics=metrics)))


def request_with(header: str | None, signature: str | None = None, app=None) -> Request:
    headers = [] if header is None else [(KV_TRANSFER_HEADER.encode(), header.encode())]
    if signature is not None:
        headers.append((KV_TRANSFER_SIGNATURE_HEADER.encode(), signature.encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    return Request({**scope, "app": app} if app is not None else scope)


def test_a_handle_header_is_parsed_into_the_typed_params():
    wire = {"prefill": "http://prefill:8000", "id": "h1", "first_token": 42}
    signed = sign_kv_transfer(KEY, KvTransferParams.from_json(wire))
    assert json.loads(signed[KV_TRANSFER_HEADER]) == wire
    params = kv_transfer_of(request_with(signed[KV_TRANSFER_HEADER], signed[KV_TRANSFER_SIGNATURE_HEADER],
                                         decode_app()))
    assert params == KvTransferParams(prefill="http://prefill:8000", id="h1", first_token=42)
    assert params.to_json() == wire
    assert kv_transfer_of(request_with(None)) is None


@pytest.mark.parametrize(("header", "why"), [
    ("not json", "Expecting value"),
    ('["prefill", "id"]', "JSON object"),
    ('{"prefill": "http://p"}', "both"),
    ('{"prefill": "http://p", "id": "x", "first_token": "7"}', "first_token"),
    ('{"export": true}', "names no prefill instance"),
    ("[" * 100_000 + "]" * 100_000, "maximum recursion"),
])
def test_a_malformed_header_is_a_400_that_says_why(header, why):
    with pytest.raises(ApiError) as raised:
        kv_transfer_of(request_with(header))
    assert raised.value.status_code == 400
    assert KV_TRANSFER_HEADER in raised.value.body and why in raised.value.body


def forged(prefill: str = "http://prefill:8000") -> str:
    """A handle header as a client could write it."""
    return json.dumps({"prefill": prefill, "id": "h1", "first_token": 42})


ATTACKER, MIXED = "http://attacker:8000", "http://prefill:8000@attacker:80"


@pytest.mark.parametrize(("prefill", "signature", "reason"), [
    ("http://prefill:8000", None, "signature"),  # a client's own header: no signature
    ("http://prefill:8000", "0" * 64, "signature"),  # a guessed one
    ("http://prefill:8000", InstanceKey(b"another deployment's key").sign("kv-transfer", forged()), "signature"),
    ("http://prefill:8000", KEY.sign("handle", forged()), "signature"),  # the key's signature for another purpose
    (ATTACKER, KEY.sign("kv-transfer", forged()), "signature"),  # a signed handle with its URL changed
    (ATTACKER, KEY.sign("kv-transfer", forged(ATTACKER)), "source"),  # signed, but not a configured source
    (MIXED, KEY.sign("kv-transfer", forged(MIXED)), "source"),
])
def test_a_forged_or_foreign_handle_is_never_used_and_is_counted(prefill, signature, reason):
    metrics = ServerMetrics()
    assert kv_transfer_of(request_with(forged(prefill), signature, decode_app(metrics))) is None
    assert metrics.kv_transfer_refused == {reason: 1}
    assert f'deepinfer_kv_transfer_refused_total{{reason="{reason}"}} 1' in metrics.render({})


def test_a_handle_sent_to_an_instance_that_is_not_a_decode_instance_is_ignored():
    metrics = ServerMetrics()
    app = SimpleNamespace(state=SimpleNamespace(kv_transfer_gate=None, server=SimpleNamespace(metrics=metrics)))
    signed = sign_kv_transfer(KEY, KvTransferParams(prefill="http://prefill:8000", id="h1", first_token=42))
    assert kv_transfer_of(request_with(signed[KV_TRANSFER_HEADER], signed[KV_TRANSFER_SIGNATURE_HEADER], app)) is None
    assert metrics.kv_transfer_refused == {"role": 1}


@pytest.mark.parametrize(("url", "normalized"), [
    ("http://Prefill:8000/", "http://prefill:8000"), ("http://prefill", "http://prefill:80"),
    ("https://p.example/pd/", "https://p.example:443/pd"),
])
def test_instance_urls_compare_normalized(url, normalized):
    assert normalized_url(url) == normalized


@pytest.mark.parametrize("url", ["ftp://prefill:21", "prefill:8000", "http://user:pw@prefill:8000", "http://p/?x=1", ""])
def test_a_url_that_is_not_an_instance_base_url_is_refused(url):
    with pytest.raises(ValueError, match="URL"):
        normalized_url(url)


def instance(role: str | None) -> SimpleNamespace:
    """What `setup_pd` reads of an engine before it builds anything."""
    return SimpleNamespace(config=SimpleNamespace(kv_transfer_role=role), prefix_tiers=None)


@pytest.mark.parametrize(("role", "key", "urls", "why"), [
    ("decode", None, ["http://prefill:8000"], "DEEPINFER_PD_SECRET"),
    ("prefill", None, [], "DEEPINFER_PD_SECRET"),
    ("decode", KEY, [], "--prefill-url"),
    (None, None, ["http://prefill:8000"], "--role decode"),
    ("prefill", KEY, ["http://prefill:8000"], "--role decode"),
])
def test_an_instance_without_its_trust_refuses_to_start(role, key, urls, why):
    from deepinfer_core.entrypoints.pd import setup_pd

    app = SimpleNamespace(state=SimpleNamespace())
    with pytest.raises(ValueError, match=why):
        setup_pd(app, SimpleNamespace(metrics=ServerMetrics()), instance(role), key, urls, "http://me:1")


def test_serve_with_a_role_and_no_instance_key_fails_before_loading_weights(monkeypatch):
    import argparse

    from deepinfer_core.entrypoints import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_serve_parser(parser.add_subparsers())
    monkeypatch.delenv("DEEPINFER_PD_SECRET", raising=False)
    monkeypatch.delenv("DEEPINFER_API_KEY", raising=False)
    args = parser.parse_args(["serve", "--role", "decode", "--prefill-url", "http://prefill:8000"])
    monkeypatch.setattr("deepinfer_core.engine.data_parallel.build_engine", lambda config: pytest.fail("loaded"))
    with pytest.raises(ValueError, match="DEEPINFER_PD_SECRET"):
        serve_cli.run_serve(args)
