"""Drive a step()-based node from asyncio: one engine thread, outputs routed to per-request queues.

The engine is not thread-safe, so every call into it (adding, aborting, reading stats) runs on
the engine thread between two steps. Serve replicas use this to stream tokens while the
batch keeps stepping.

The engine thread is also where the engine is built (``EngineThread``): libgomp keeps a pool of
OpenMP threads for each thread that has run a parallel region, and once a process holds more
of them than it has cores, its threads stop spinning at barriers and sleep in every region.
An engine built on one thread and stepped on another ran that way (docs/benchmarks.md,
2026-12-03: one engine on two cores at 2 req/s, 1.2x the TPOT p50 and 1.3x the TTFT p50).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from duet.errors import WorkerDiedError

logger = logging.getLogger(__name__)


# A step that gave no outputs while work exists only in the background (a KV transfer coming in)
# waits this long before the next, rather than spinning a core the transfer and the other
# replicas need.
BUSY_POLL_S = 0.002


class EngineLoopError(RuntimeError):
    """A step failed; every request in flight at that moment gets this error."""


class EngineThread:
    """A thread that runs what it is given, in order (``run``: the engine's build, and anything
    else that must run where it will step), until an ``EngineLoop`` takes it over."""

    def __init__(self, name: str = "engine-loop") -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable, *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)`` on this thread; its result, or its exception raised here."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._work.put((fn, args, kwargs, future))
        return future.result()

    def hand_over(self, forever: Callable[[], None]) -> None:
        """Run ``forever`` on this thread; the thread ends when it returns."""
        self._work.put((forever, (), {}, None))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _serve(self) -> None:
        while True:
            fn, args, kwargs, future = self._work.get()
            if future is None:
                fn()
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - raised in the caller
                future.set_exception(error)


class EngineLoop:
    """Runs ``step()`` on a thread whenever ``has_work()``; ``key(output)`` names its request.

    ``on_idle()`` runs on the engine thread each time the work runs out (a bookkeeping check
    that must see the engine at rest); its exceptions are logged, never raised. ``thread``: the
    ``EngineThread`` the engine was built on (None: a new one).
    """

    def __init__(
        self,
        step: Callable[[], list],
        key: Callable[[Any], str],
        has_work: Callable[[], bool],
        busy_poll_s: float = BUSY_POLL_S,
        idle_wait_s: float = 0.05,
        name: str = "engine-loop",
        on_idle: Callable[[], None] | None = None,
        thread: EngineThread | None = None,
    ) -> None:
        self._step = step
        self._key = key
        self._has_work = has_work
        self._on_idle = on_idle
        self._busy = False
        self._busy_poll_s = busy_poll_s
        self._idle_wait_s = idle_wait_s
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._dead_worker: WorkerDiedError | None = None  # once a worker died, no step can run
        self._thread = thread or EngineThread(name)
        self._thread.hand_over(self._run)

    async def call(self, fn: Callable, *args, **kwargs) -> Any:
        """Run ``fn`` on the engine thread between steps and return (or raise) its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((fn, args, kwargs, loop, future))
        self._wake.set()
        return await future

    def wake(self) -> None:
        """Step now if there is work (from any thread): a KV transfer ended."""
        self._wake.set()

    def call_soon(self, fn: Callable, *args) -> None:
        """Run ``fn`` on the engine thread without waiting (aborts from cancelled requests)."""
        self._calls.put((fn, args, {}, None, None))
        self._wake.set()

    def subscribe(self, request_id: str) -> asyncio.Queue:
        """A queue that receives every output for ``request_id`` (subscribe before adding it).
        Ids are unique among the requests here: a second one would take the first one's outputs."""
        if request_id in self._subscribers:
            raise RuntimeError(f"request {request_id} is already running here")
        outputs: asyncio.Queue = asyncio.Queue()
        self._subscribers[request_id] = (asyncio.get_running_loop(), outputs)
        return outputs

    def unsubscribe(self, request_id: str) -> None:
        self._subscribers.pop(request_id, None)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopped:
            self._run_calls()
            if self._has_work() and self._dead_worker is None:
                self._busy = True
                self._run_step()
                continue
            if self._busy:
                self._busy = False
                self._run_on_idle()
            self._wake.wait(self._idle_wait_s)
            self._wake.clear()

    def _run_on_idle(self) -> None:
        if self._on_idle is None:
            return
        try:
            self._on_idle()
        except Exception:  # noqa: BLE001 - the hook reports; the loop goes on
            logger.exception("idle check failed")

    def _run_calls(self) -> None:
        while True:
            try:
                fn, args, kwargs, loop, future = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                if future is None:
                    logger.exception("engine call %s failed", getattr(fn, "__name__", fn))
                else:
                    loop.call_soon_threadsafe(_settle, future, None, error)
            else:
                if future is not None:
                    loop.call_soon_threadsafe(_settle, future, result, None)

    def _run_step(self) -> None:
        try:
            outputs = self._step()
        except WorkerDiedError as error:
            # The sequences are lost with the replica and may go on elsewhere; no step can run
            # again here (calls still do: aborts, stats), and Serve replaces the replica.
            logger.error("a worker died; failing the %d requests in flight and stepping no more: %s", len(self._subscribers), error)
            self._dead_worker = error
            for request_id in list(self._subscribers):
                self._deliver(request_id, WorkerDiedError(str(error)))
            return
        except Exception as error:  # noqa: BLE001 - a bug must not kill the replica
            logger.exception("engine step failed; failing the %d requests in flight", len(self._subscribers))
            for request_id in list(self._subscribers):
                self._deliver(request_id, EngineLoopError(f"engine step failed: {error!r}"))
            return
        if not outputs:
            # Runnable work exists only in the background (transfers): do not spin a core.
            self._wake.wait(self._busy_poll_s)
            self._wake.clear()
        # A step's outputs reach each event loop in one callback: readers that batch what they
        # are given (a router's channel, duet.decode_node.channel) see the whole step at once.
        puts: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            subscriber = self._subscribers.get(self._key(output))
            if subscriber is not None:
                puts.setdefault(subscriber[0], []).append((subscriber[1], output))
        for loop, items in puts.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, request_id: str, item: Any) -> None:
        subscriber = self._subscribers.get(request_id)
        if subscriber is not None:
            loop, outputs = subscriber
            loop.call_soon_threadsafe(outputs.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
