"""32 concurrent streaming clients, a quarter of which disconnect midway, on the real engine."""

from __future__ import annotations

import asyncio

import httpx
import openai

from tests.entrypoints.live import SERVED_NAME, LiveServer

NUM_CLIENTS = 32
MAX_TOKENS = 12
NO_THINKING = {"thinking": {"type": "disabled"}}


async def complete(client: openai.AsyncOpenAI, index: int) -> dict:
    messages = [{"role": "user", "content": f"Client {index}: tell me a story."}]
    stream = await client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                  stream=True, extra_body=NO_THINKING)
    chunks = [chunk async for chunk in stream]
    return {"messages": messages, "usage": chunks[-1].usage,
            "finish_reason": next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices),
            "text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)}


async def disconnect_midway(client: openai.AsyncOpenAI, index: int) -> int:
    # Far more tokens than the test waits for: only the disconnect can end these requests in time.
    stream = await client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": f"Client {index}: go on forever."}],
        max_tokens=1500, stream=True, extra_body=NO_THINKING)
    received = 0
    async for _ in stream:
        received += 1
        if received == 3:
            break
    await stream.close()
    return received


async def run_clients(base_url: str) -> tuple[list, list]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    dropping = set(range(0, NUM_CLIENTS, 4))
    tasks = [disconnect_midway(client, i) if i in dropping else complete(client, i) for i in range(NUM_CLIENTS)]
    results = await asyncio.gather(*tasks)
    await client.close()
    return ([r for i, r in enumerate(results) if i not in dropping], [r for i, r in enumerate(results) if i in dropping])


def aborted_count(base_url: str) -> int:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith('deepinfer_requests_total{api="chat",outcome="aborted"}'):
            return int(line.rsplit(" ", 1)[1])
    return 0


def engine_state(live_server: LiveServer, timeout_s: float = 15.0) -> dict:
    """Wait until the engine holds no request, then read its bookkeeping on the loop thread."""
    def read(engine) -> dict:
        manager = engine.block_manager
        return {"busy": engine.has_unfinished_requests(), **engine.stats(),
                "referenced_blocks": sum(manager.ref_count(i) > 0 for i in range(manager.num_blocks))}

    async def poll() -> dict:
        for _ in range(int(timeout_s / 0.05)):
            state = await live_server.state.engine.call(read)
            if not state["busy"]:
                return state
            await asyncio.sleep(0.05)
        return state

    return asyncio.run(poll())


def test_concurrent_streams_with_disconnects(live_server: LiveServer) -> None:
    aborted_before = aborted_count(live_server.base_url)
    completed, dropped = asyncio.run(run_clients(live_server.base_url))

    assert len(completed) == 24 and all(received == 3 for received in dropped)
    for result in completed:
        usage = result["usage"]
        expected_prompt = live_server.state.encoding.prepare(
            "chat", {"model": SERVED_NAME, "messages": result["messages"], **NO_THINKING}, 2048).prompt_token_ids
        assert usage.prompt_tokens == len(expected_prompt)
        assert 1 <= usage.completion_tokens <= MAX_TOKENS
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        if result["finish_reason"] == "length":
            assert usage.completion_tokens == MAX_TOKENS

    state = engine_state(live_server)
    assert not state["busy"] and state["num_running"] == 0 and state["num_waiting"] == 0
    assert state["referenced_blocks"] == 0 and state["num_free_blocks"] == state["num_blocks"]
    assert aborted_count(live_server.base_url) - aborted_before == len(dropped)
