"""Admission control: who runs, who waits in order, who is refused."""

from __future__ import annotations

import asyncio

import pytest

from duet.router.admission import AdmissionQueue, QueueFullError


def test_over_running_and_queued_limits_is_refused_and_slots_pass_on_in_order():
    async def scenario():
        queue = AdmissionQueue(max_running=1, max_queued=2)
        await queue.acquire()
        order = []

        async def wait(name):
            await queue.acquire()
            order.append(name)

        first, second = asyncio.create_task(wait("first")), asyncio.create_task(wait("second"))
        await asyncio.sleep(0)
        assert (queue.num_running, queue.num_queued) == (1, 2)
        with pytest.raises(QueueFullError):
            await queue.acquire()
        queue.release()
        await first
        assert order == ["first"] and queue.num_running == 1 and queue.num_queued == 1
        queue.release()
        await second
        queue.release()
        assert (queue.num_running, queue.num_queued) == (0, 0)

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_leaks_no_slot():
    async def scenario():
        queue = AdmissionQueue(max_running=1, max_queued=1)
        await queue.acquire()
        waiter = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert queue.num_queued == 0
        queue.release()
        assert queue.num_running == 0
        await queue.acquire()  # the slot is free again
        assert queue.num_running == 1

    asyncio.run(scenario())


def test_a_waiter_cancelled_after_being_handed_the_slot_gives_it_back():
    async def scenario():
        queue = AdmissionQueue(max_running=1, max_queued=1)
        await queue.acquire()
        waiter = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0)
        queue.release()  # hands the slot to the waiter...
        waiter.cancel()  # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (queue.num_running, queue.num_queued) == (0, 0)

    asyncio.run(scenario())
