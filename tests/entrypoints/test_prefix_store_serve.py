"""`deepinfer serve` over a prefix store: a restarted server reports store hits in usage and /metrics."""

from __future__ import annotations

import httpx
import openai

from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import running_server
from tests.entrypoints.live import SERVED_NAME, tiny_engine

NO_THINKING = {"thinking": {"type": "disabled"}}  # DeepSeek's switch: with thinking on, temperature is 1.0
AGENT = {"x-deepinfer-traffic-class": "agent"}


def metric_samples(base_url: str) -> dict[str, str]:
    text = httpx.get(f"{base_url}/metrics").text
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))


def ask(base_url: str, messages: list[dict]) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    return client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=1, extra_body=NO_THINKING,
                                          extra_headers=AGENT)


def test_a_restarted_server_serves_the_prefix_from_the_store(tmp_path):
    messages = [{"role": "user", "content": " ".join(f"step {i} returned ok." for i in range(120))}]
    store = tmp_path / "kv"
    engine = tiny_engine(prefix_store_path=str(store), host_cache_gib=0.01)
    app = build_app(engine, served_model_name=SERVED_NAME)
    with running_server(app) as base_url:
        first = ask(base_url, messages)
    engine.shutdown()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert list((store / "agent").rglob("*.blk")) and not (store / "chat").exists()  # the header's class
    engine = tiny_engine(prefix_store_path=str(store))
    with running_server(build_app(engine, served_model_name=SERVED_NAME)) as base_url:
        second = ask(base_url, messages)
        samples = metric_samples(base_url)
    assert second.usage.prompt_tokens_details.cached_tokens >= 128
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content
    hits = second.usage.prompt_tokens_details.cached_tokens
    assert samples['deepinfer_prefix_cache_hit_tokens_total{tier="store"}'] == str(hits)
    assert samples['deepinfer_prefix_cache_hit_tokens_total{tier="device"}'] == "0"
    assert float(samples['deepinfer_prefix_cache_tier_hit_rate{tier="store"}']) > 0
    assert int(samples['deepinfer_prefix_cache_bytes_moved_total{path="store_read"}']) > 0
    assert int(samples["deepinfer_prefix_store_blocks"]) >= hits // 128
    assert samples["deepinfer_prefix_store_loads_total"] == "1"


def test_an_unknown_traffic_class_is_a_400(tmp_path):
    engine = tiny_engine(prefix_store_path=str(tmp_path / "kv"))
    with running_server(build_app(engine, served_model_name=SERVED_NAME)) as base_url:
        response = httpx.post(f"{base_url}/v1/chat/completions", headers={"x-deepinfer-traffic-class": "batch"},
                              json={"model": SERVED_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and "traffic_class 'batch'" in response.text
