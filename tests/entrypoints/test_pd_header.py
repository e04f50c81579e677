"""The decode instance's `kv_transfer_params` header (`entrypoints.pd.kv_transfer_of`): parsed once, into
the typed handle, with the wire JSON unchanged; a malformed one is a 400 that says what is wrong. (The
PD end-to-end tests in test_pd.py need NIXL; these do not.)"""

from __future__ import annotations

import json

import pytest
from starlette.requests import Request

from deepinfer_core.chat_contract import ApiError
from deepinfer_core.entrypoints.pd import KV_TRANSFER_HEADER, kv_transfer_of
from deepinfer_core.sampling_params import KvTransferParams


def request_with(header: str | None) -> Request:
    headers = [] if header is None else [(KV_TRANSFER_HEADER.encode(), header.encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers})


def test_a_handle_header_is_parsed_into_the_typed_params():
    wire = {"prefill": "http://prefill:8000", "id": "h1", "first_token": 42}
    params = kv_transfer_of(request_with(json.dumps(wire)))
    assert params == KvTransferParams(prefill="http://prefill:8000", id="h1", first_token=42)
    assert params.to_json() == wire
    assert kv_transfer_of(request_with(None)) is None


@pytest.mark.parametrize(("header", "why"), [
    ("not json", "Expecting value"),
    ('["prefill", "id"]', "JSON object"),
    ('{"prefill": "http://p"}', "both"),
    ('{"prefill": "http://p", "id": "x", "first_token": "7"}', "first_token"),
    ('{"export": true}', "names no prefill instance"),
])
def test_a_malformed_header_is_a_400_that_says_why(header, why):
    with pytest.raises(ApiError) as raised:
        kv_transfer_of(request_with(header))
    assert raised.value.status_code == 400
    assert KV_TRANSFER_HEADER in raised.value.body and why in raised.value.body
