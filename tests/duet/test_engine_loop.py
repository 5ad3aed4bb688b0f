"""EngineLoop: calls run on the engine thread, outputs reach their subscriber, a failing step
fails the requests in flight without stopping the loop."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from duet.engine_loop import EngineLoop, EngineLoopError, EngineThread


@dataclass
class Output:
    request_id: str
    value: int


class FakeNode:
    def __init__(self):
        self.pending: list[str] = []
        self.fail_next = False
        self.threads: set[str] = set()

    def add(self, request_id: str) -> str:
        self.threads.add(threading.current_thread().name)
        self.pending.append(request_id)
        return request_id

    def step(self) -> list[Output]:
        self.threads.add(threading.current_thread().name)
        if self.fail_next:
            self.fail_next = False
            self.pending.clear()
            raise RuntimeError("boom")
        outputs = [Output(request_id, index) for index, request_id in enumerate(self.pending)]
        self.pending.clear()
        return outputs


def test_calls_and_steps_run_on_the_engine_thread_and_outputs_reach_subscribers():
    node = FakeNode()
    loop = EngineLoop(node.step, lambda output: output.request_id, lambda: bool(node.pending), name="test-loop")

    async def scenario():
        a, b = loop.subscribe("a"), loop.subscribe("b")
        assert await loop.call(node.add, "a") == "a"
        await loop.call(node.add, "b")
        got = {(await a.get()).request_id, (await b.get()).request_id}
        assert got == {"a", "b"}
        with pytest.raises(KeyError):
            await loop.call({}.__getitem__, "missing")

    try:
        asyncio.run(scenario())
    finally:
        loop.stop()
    assert node.threads == {"test-loop"}


def test_a_failing_step_reports_to_every_subscriber_and_the_loop_goes_on():
    node = FakeNode()
    loop = EngineLoop(node.step, lambda output: output.request_id, lambda: bool(node.pending))

    async def scenario():
        outputs = loop.subscribe("x")
        node.fail_next = True
        await loop.call(node.add, "x")
        assert isinstance(await outputs.get(), EngineLoopError)
        await loop.call(node.add, "x")
        assert (await outputs.get()).request_id == "x"

    try:
        asyncio.run(scenario())
    finally:
        loop.stop()


def test_a_dead_worker_is_passed_on_to_each_request_and_no_step_runs_again():
    """Guards the replica's view of a lost worker: each subscriber gets a WorkerDiedError of its
    own (the router recomputes those sequences elsewhere), and the loop stops stepping, though
    work remains, instead of failing the same way as fast as it can; calls still run."""
    from duet.errors import WorkerDiedError

    steps = []

    def step():
        steps.append(1)
        raise WorkerDiedError("worker rank 1 died")

    subscribed = threading.Event()
    loop = EngineLoop(step, lambda output: output.request_id, subscribed.is_set, idle_wait_s=0.01, name="test-loop")

    async def scenario():
        first, second = loop.subscribe("a"), loop.subscribe("b")
        subscribed.set()
        failures = [await first.get(), await second.get()]
        assert all(isinstance(failure, WorkerDiedError) and str(failure) == "worker rank 1 died" for failure in failures)
        assert failures[0] is not failures[1]
        await asyncio.sleep(0.2)
        assert await loop.call(lambda: "still answers") == "still answers"

    try:
        asyncio.run(scenario())
    finally:
        loop.stop()
    assert len(steps) == 1


def test_an_engine_thread_builds_what_its_loop_then_steps_and_raises_its_errors_in_the_caller():
    thread = EngineThread("test-loop")
    node = thread.run(FakeNode)
    built_on = thread.run(threading.get_ident)
    with pytest.raises(ZeroDivisionError):
        thread.run(lambda: 1 / 0)
    stepped_on: set[int] = set()
    step = node.step
    node.step = lambda: (stepped_on.add(threading.get_ident()), step())[1]
    loop = EngineLoop(node.step, lambda output: output.request_id, lambda: bool(node.pending), thread=thread)

    async def scenario():
        outputs = loop.subscribe("a")
        await loop.call(node.add, "a")
        return (await outputs.get()).request_id

    try:
        assert asyncio.run(scenario()) == "a"
    finally:
        loop.stop()
    assert stepped_on == {built_on} and not thread.is_alive()
