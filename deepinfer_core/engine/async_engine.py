"""An asyncio streaming front for the synchronous `Engine`.

The engine is not thread-safe, so one background thread owns it: it takes new requests and aborts from
a queue, runs `engine.step()` while there is work, and hands each `RequestOutput` to the event loop of
the request that asked for it. Requests that arrive together are batched by the engine's own scheduler.

    async_engine = AsyncEngine(engine)
    async for output in async_engine.generate(prompt_ids, SamplingParams(max_tokens=32), "req-1"):
        print(output.outputs[0].token_ids)   # cumulative
    async_engine.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from deepinfer_core.executor.protocol import WorkerError

if TYPE_CHECKING:
    from deepinfer_core.engine.engine import Engine
    from deepinfer_core.outputs import RequestOutput
    from deepinfer_core.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or a step raised); no request can be served."""


@dataclass
class _Stream:
    """Where the loop thread delivers one request's outputs: an asyncio queue on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue

    def deliver(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed; nobody is listening any more
            pass


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stream: _Stream
    images: tuple = ()


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Engine], Any]
    future: Future


class AsyncEngine:
    """Runs `engine` on a background thread and streams its outputs to asyncio callers.

    :param engine: the synchronous engine; after this, only the loop thread may call it.
    :param idle_poll_s: how long the idle loop waits for a new command before checking for shutdown.
    """

    def __init__(self, engine: Engine, idle_poll_s: float = 0.1) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._idle_poll_s = idle_poll_s
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.last_stats: dict[str, Any] = {}
        """The engine's `stats()` after the latest step (read it from any thread)."""
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """Whether the loop thread is alive and can take requests."""
        return self._thread.is_alive() and not self._stop.is_set()

    async def generate(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams, request_id: str, images: tuple = ()
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its `RequestOutput`s as the engine produces them (token ids cumulative).
        `images`: the prompt's images, laid into the ids (`Engine.prepare_images`, safe from any thread).

        Leaving the iteration early (break, cancellation, a closed client) aborts the request.

        :raises ValueError: the engine rejected the request (bad prompt or sampling parameters).
        :raises EngineDeadError: the engine loop is not running.
        """
        self._check_alive()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(_Add(request_id, list(prompt_token_ids), sampling_params, stream, tuple(images)))
        finished = False
        try:
            while True:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds; unknown or finished ids are ignored. Thread-safe."""
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the loop thread, between steps, and return its result."""
        self._check_alive()
        future: Future = Future()
        self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop thread; pending requests end with `EngineDeadError`."""
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout_s)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error!r}") from self._error
        if not self.is_running:
            raise EngineDeadError("the engine loop is shut down")

    # -- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                has_work = self.engine.has_unfinished_requests()
                self._handle_commands(block=not has_work)
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                    self.last_stats = self.engine.stats()
        except BaseException as err:  # a failed step ends every request with the error
            self._error = err
            # the one line that says why the engine died (a worker's cause names its rank); the traceback
            # only for what is not a worker's report, whose own traceback the worker already sent
            logger.error("the engine stopped; every open request ends with an error: %s", err,
                         exc_info=None if isinstance(err, WorkerError) else err)
        finally:
            self._stop.set()
            self._fail_all(self._error)

    def _handle_commands(self, block: bool) -> None:
        """Apply every queued command; when idle, wait for the first one."""
        while True:
            try:
                command = self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if command is None:
                return
            self._apply(command)

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids, command.sampling_params,
                                        images=command.images)
            except (ValueError, NotImplementedError) as err:
                command.stream.deliver(err)
                return
            self._streams[command.request_id] = command.stream
        elif isinstance(command, _Abort):
            if self._streams.pop(command.request_id, None) is not None:
                self.engine.abort(command.request_id)
                self.last_stats = self.engine.stats()
        else:
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as err:  # noqa: BLE001 - handed to the caller
                command.future.set_exception(err)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.deliver(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all(self, error: BaseException | None) -> None:
        dead = EngineDeadError("the engine loop stopped" + (f": {error!r}" if error else ""))
        for request_id, stream in self._streams.items():
            stream.deliver(dead)
            if error is None:  # a clean shutdown leaves the engine holding nothing
                self.engine.abort(request_id)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.stream.deliver(dead)
            elif isinstance(command, _Call):
                command.future.set_exception(dead)
