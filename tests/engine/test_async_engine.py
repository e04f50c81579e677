"""AsyncEngine over the real engine on the embedded tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.async_engine import AsyncEngine, EngineDeadError
from deepinfer_core.engine.engine import Engine
from deepinfer_core.sampling_params import SamplingParams
from deepinfer_core.testing.checkpoints import embedded_tiny_model_dir

PROMPT = [0, 5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module", params=[False, True], ids=["step-by-step", "overlapped"])
def engine(request) -> Engine:
    return Engine(EngineConfig(model=str(embedded_tiny_model_dir()), device="cpu", max_model_len=512,
                               async_scheduling=request.param))


@pytest.fixture
def async_engine(engine: Engine) -> Iterator[AsyncEngine]:
    front = AsyncEngine(engine)
    yield front
    front.shutdown()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def collect(front: AsyncEngine, request_id: str, prompt: list[int], max_tokens: int) -> list:
    return [output async for output in front.generate(prompt, greedy(max_tokens), request_id)]


def test_streams_cumulative_outputs_equal_to_the_sync_engine(engine: Engine) -> None:
    engine.add_request("sync", PROMPT, greedy(6))
    expected = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            expected = output.outputs[0].token_ids
    front = AsyncEngine(engine)
    try:
        outputs = asyncio.run(collect(front, "async", PROMPT, 6))
    finally:
        front.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4, 5, 6]
    assert [o.finished for o in outputs] == [False] * 5 + [True]
    assert outputs[-1].outputs[0].token_ids == expected


def test_concurrent_requests_share_steps(engine: Engine, async_engine: AsyncEngine, monkeypatch) -> None:
    batch_sizes = []
    real_step = engine.step

    def counting_step():
        outputs = real_step()
        batch_sizes.append(len(outputs))
        return outputs

    monkeypatch.setattr(engine, "step", counting_step)

    async def main() -> list[list]:
        return await asyncio.gather(*(collect(async_engine, f"c{i}", PROMPT + [i + 20], 5) for i in range(4)))

    results = asyncio.run(main())
    assert all(r[-1].finished and len(r[-1].outputs[0].token_ids) == 5 for r in results)
    assert max(batch_sizes) == 4  # every request progressed in the same step at least once


def test_leaving_early_aborts_the_request(async_engine: AsyncEngine) -> None:
    async def main() -> tuple[int, bool]:
        received = 0
        stream = async_engine.generate(PROMPT, greedy(400), "early")
        async for _ in stream:
            received += 1
            if received == 2:
                break
        await stream.aclose()
        # The abort travels through the command queue before this call runs.
        return received, await async_engine.call(lambda e: e.has_unfinished_requests())

    received, busy = asyncio.run(main())
    assert received == 2 and not busy
    assert async_engine.last_stats["num_running"] == 0


def test_rejected_request_raises_value_error(async_engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(collect(async_engine, "empty", [], 3))
    assert async_engine.is_running  # a bad request does not stop the loop


def test_shutdown_ends_pending_and_new_requests(engine: Engine) -> None:
    front = AsyncEngine(engine)

    async def main() -> None:
        stream = front.generate(PROMPT, greedy(400), "pending")
        await anext(stream)
        front.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(main())
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(front, "late", PROMPT, 2))
    assert not engine.has_unfinished_requests()  # shutdown aborted what was pending
