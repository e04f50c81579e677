"""Prefill/decode disaggregation: a prefill instance, a decode instance and a router as three processes on
127.0.0.1, driven by the openai SDK; KV blocks move by NIXL (UCX, DRAM to DRAM). All three run with
`--api-key`, which is also the instance key they authenticate each other with."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from deepinfer_core.entrypoints.router import Instance, NoHealthyInstanceError, Pool
from deepinfer_core.entrypoints.serve import build_app
from deepinfer_core.entrypoints.serve_cli import running_server
from tests.entrypoints.live import SERVED_NAME, tiny_engine

pytest.importorskip("nixl_cu13._api", reason="prefill/decode disaggregation needs NIXL (the pd extra: nixl-cu13)")

NO_THINKING = {"thinking": {"type": "disabled"}}  # DeepSeek's switch: with thinking on, temperature is 1.0
API_KEY = "pd-test-key"
LONG = " ".join(f"tool call {i} returned status ok with value {i * 7}." for i in range(60))
MESSAGES = [{"role": "user", "content": LONG}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric_samples(url: str) -> dict[str, str]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))


def start(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "UCX_NET_DEVICES": "lo"}
    env.pop("DEEPINFER_PD_SECRET", None)  # the API key is the instance key
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer_core.cli", *args, "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 420.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout_s:g} s")


@pytest.fixture(scope="module")
def cluster():
    serve = ["serve", "--max-model-len", "2048", "--max-num-seqs", "4", "--served-model-name", SERVED_NAME,
             "--api-key", API_KEY]
    prefill, prefill_url = start(*serve, "--role", "prefill", "--max-num-batched-tokens", "32")
    decode, decode_url = start(*serve, "--role", "decode", "--prefill-url", prefill_url)
    # one more prefill and decode instance each that never started: the router takes them out of rotation
    dead_prefill, dead_decode = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    router, router_url = start("router", "--prefill", dead_prefill, "--prefill", prefill_url, "--decode", dead_decode,
                               "--decode", decode_url, "--health-interval", "0.5", "--api-key", API_KEY)
    procs = {"prefill": prefill, "decode": decode, "router": router}
    try:
        for proc, url in ((prefill, prefill_url), (decode, decode_url), (router, router_url)):
            wait_healthy(proc, url)
        yield {"prefill": prefill_url, "decode": decode_url, "router": router_url, "procs": procs,
               "dead": (dead_prefill, dead_decode)}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def single_answer() -> openai.types.chat.ChatCompletion:
    with running_server(build_app(tiny_engine(), served_model_name=SERVED_NAME, api_key=API_KEY)) as base_url:
        return client(base_url).chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=8,
                                                         temperature=0, extra_body=NO_THINKING)


def client(base_url: str, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)


def test_the_router_answers_as_a_single_instance(cluster, single_answer):
    before = metric_samples(cluster["decode"])
    oai = client(cluster["router"])
    answer = oai.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                         extra_body=NO_THINKING)
    assert answer.choices[0].message.content == single_answer.choices[0].message.content
    assert answer.usage.prompt_tokens == single_answer.usage.prompt_tokens
    # the decode instance took the whole prompt from the prefill instance: blocks, windows, tails, first token
    assert answer.usage.prompt_tokens_details.cached_tokens == answer.usage.prompt_tokens
    stream = oai.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=8, temperature=0,
                                         extra_body=NO_THINKING, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer.choices[0].message.content
    decode = metric_samples(cluster["decode"])
    assert int(decode["deepinfer_kv_transfer_blocks_in_total"]) >= 1
    assert int(decode['deepinfer_prefix_cache_hit_tokens_total{tier="remote"}']) >= 128
    assert decode["deepinfer_kv_transfer_failures_total"] == "0"
    states, computed = "deepinfer_kv_transfer_states_in_total", "deepinfer_prefill_computed_tokens_total"
    assert int(decode[states]) - int(before.get(states, 0)) == 2  # (an engine that never stepped reports no tiers)
    assert int(decode[computed]) == int(before.get(computed, 0))  # not one prompt token computed on decode
    assert decode["deepinfer_prefix_cache_replay_tokens_total"] == "0"
    router = metric_samples(cluster["router"])
    assert router[f'deepinfer_router_requests_total{{role="prefill",instance="{cluster["prefill"]}"}}'] == "2"
    health = httpx.get(f"{cluster['router']}/health", timeout=10).json()
    assert {i["url"]: i["healthy"] for i in health["prefill"] + health["decode"]} == {
        cluster["prefill"]: True, cluster["decode"]: True, cluster["dead"][0]: False, cluster["dead"][1]: False}


def test_under_an_api_key_the_router_checks_it_and_the_instances_authenticate_each_other(cluster, single_answer):
    router = cluster["router"]
    assert SERVED_NAME in [m.id for m in client(router).models.list().data]  # a valid key passes /v1/models
    for wrong in (client(router, "wrong-key"), client(cluster["decode"], "wrong-key")):
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    # a client cannot reach the prefill instance's internal routes, even with the API key
    body = {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 1}
    direct = httpx.post(f"{cluster['prefill']}/v1/pd/prefill/chat", json=body, timeout=30,
                        headers={"authorization": f"Bearer {API_KEY}"})
    assert direct.status_code == 403
    assert httpx.get(f"{cluster['prefill']}/pd/handles/anything", timeout=10).status_code == 403
    # the decode instance read the handle with the key: a transfer, not a recompute
    before = metric_samples(cluster["decode"])
    answer = client(router).chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=8,
                                                    temperature=0, extra_body=NO_THINKING)
    assert answer.choices[0].message.content == single_answer.choices[0].message.content
    after = metric_samples(cluster["decode"])
    states = "deepinfer_kv_transfer_states_in_total"
    assert int(after[states]) - int(before[states]) == 1
    assert after["deepinfer_kv_transfer_failures_total"] == "0"
    assert after["deepinfer_prefill_computed_tokens_total"] == before["deepinfer_prefill_computed_tokens_total"]


def test_a_prefill_instance_killed_mid_request_is_a_clear_error_and_leaks_nothing(cluster):
    before = metric_samples(cluster["decode"])
    outcome: dict[str, BaseException] = {}

    def ask() -> None:
        try:
            client(cluster["router"]).chat.completions.create(
                model=SERVED_NAME, max_tokens=4, extra_body=NO_THINKING,
                messages=[{"role": "user", "content": LONG + " " + LONG + " Summarise."}])
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            outcome["error"] = err

    thread = threading.Thread(target=ask)
    thread.start()
    deadline = time.monotonic() + 60
    while metric_samples(cluster["prefill"]).get("deepinfer_num_requests_running") != "1":
        assert time.monotonic() < deadline, "the request never reached the prefill instance's engine"
        time.sleep(0.01)
    cluster["procs"]["prefill"].send_signal(signal.SIGKILL)
    thread.join(60)
    error = outcome.get("error")
    assert isinstance(error, openai.InternalServerError) and error.status_code == 503
    assert f"the prefill instance {cluster['prefill']} failed" in str(error)
    after = metric_samples(cluster["decode"])
    assert after["deepinfer_num_requests_running"] == after["deepinfer_num_requests_waiting"] == "0"
    assert after["deepinfer_num_requests_loading"] == "0"
    requests = [k for k in after if k.startswith("deepinfer_requests_total")]
    assert {k: after[k] for k in requests} == {k: before.get(k) for k in requests}  # it never reached decode


def test_with_no_healthy_prefill_instance_left_the_client_gets_a_clear_error(cluster):
    # runs after the prefill instance was killed: the health checks take it out of rotation
    deadline = time.monotonic() + 60
    while httpx.get(f"{cluster['router']}/health", timeout=10).status_code != 503:
        assert time.monotonic() < deadline, "the router never noticed the dead prefill instance"
        time.sleep(0.1)
    with pytest.raises(openai.InternalServerError) as raised:
        client(cluster["router"]).chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=4,
                                                          extra_body=NO_THINKING)
    assert raised.value.status_code == 503 and "no healthy prefill instance is left" in str(raised.value)
    assert cluster["prefill"] in str(raised.value)


def test_the_router_balances_by_requests_in_flight_over_healthy_instances():
    pool = Pool("decode", [Instance("a"), Instance("b"), Instance("c")])
    pool.instances[0].num_in_flight, pool.instances[1].num_in_flight = 2, 1
    assert pool.pick().url == "c"
    pool.instances[2].num_in_flight = 1
    picks = {pool.pick().url for _ in range(4)}
    assert picks == {"b", "c"}  # ties take turns; the busiest is never picked
    pool.instances[2].mark_down("refused a connection")
    assert {pool.pick().url for _ in range(4)} == {"b"}  # out of rotation
    assert pool.pick(exclude=(pool.instances[1],)).url == "a"
    pool.instances[0].mark_down("health check failed")
    with pytest.raises(NoHealthyInstanceError, match="no healthy decode instance is left"):
        pool.pick(exclude=(pool.instances[1],))
