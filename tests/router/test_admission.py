"""Admission control: who runs, who waits in order, who is refused."""

from __future__ import annotations

import asyncio

import pytest

from duet.router.admission import MIN_HOLDS, AdmissionQueue, QueueFullError, QueueWaitError


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


def test_admission_counts_sequences_so_a_fan_out_cannot_crowd_out_others():
    """Guards the fan-out report: one request of 256 prompts x n=4 counted as one request and
    took every seat; a concurrent 8-token request then waited 37 s. Now a request costs its
    sequences, one larger than the whole budget runs alone, and nobody overtakes it."""

    async def scenario():
        queue = AdmissionQueue(max_running=8, max_queued=4)
        await queue.acquire(3)
        await queue.acquire(4)
        assert queue.num_running == 7
        big = asyncio.create_task(queue.acquire(1024))  # capped at the budget: runs alone
        await asyncio.sleep(0)
        small = asyncio.create_task(queue.acquire(1))  # would fit now, but queues behind big
        await asyncio.sleep(0)
        assert (queue.num_running, queue.num_queued) == (7, 2)
        queue.release(3)
        await asyncio.sleep(0)
        assert not big.done()
        queue.release(4)
        await big
        assert (queue.num_running, queue.num_queued) == (8, 1) and not small.done()
        queue.release(1024)
        await small
        queue.release(1)
        assert (queue.num_running, queue.num_queued) == (0, 0)

    asyncio.run(scenario())


def test_a_cancelled_large_waiter_lets_the_smaller_ones_behind_it_in():
    async def scenario():
        queue = AdmissionQueue(max_running=4, max_queued=4)
        await queue.acquire(2)
        big = asyncio.create_task(queue.acquire(4))
        await asyncio.sleep(0)
        small = asyncio.create_task(queue.acquire(2))
        await asyncio.sleep(0)
        big.cancel()
        with pytest.raises(asyncio.CancelledError):
            await big
        await small
        assert (queue.num_running, queue.num_queued) == (4, 0)

    asyncio.run(scenario())


def test_an_admission_dropped_without_ending_gives_its_sequences_back():
    """A stream the client leaves before it begins never runs its generator's clean-up; its
    admission must still come back (else every such client costs a seat for good)."""
    from duet.router.admission import Admitted

    async def scenario():
        queue = AdmissionQueue(max_running=4, max_queued=4)
        await queue.acquire(3)
        admitted = Admitted(queue, 3)
        del admitted
        assert queue.num_running == 0
        await queue.acquire(2)
        once = Admitted(queue, 2)
        once.release()
        once.release()
        assert queue.num_running == 0

    asyncio.run(scenario())


def test_a_request_predicted_to_wait_past_the_limit_is_refused_at_once():
    """Little's law over recent holds: 2 slots, requests holding them 10 s each, 2 running and
    2 queued: a fifth would wait for 3 slots, 15 s; with a 12 s limit it is refused now (with
    when to retry), while a limit of 20 s queues it."""

    async def scenario(limit):
        now = [0.0]
        queue = AdmissionQueue(max_running=2, max_queued=10, max_queue_wait_s=limit, clock=lambda: now[0])
        for _ in range(MIN_HOLDS):
            await queue.acquire()
            now[0] += 10.0
            queue.release(held_s=10.0)
        await queue.acquire(2)
        waiting = [asyncio.create_task(queue.acquire()) for _ in range(2)]
        await asyncio.sleep(0)
        assert queue.predicted_wait_s() == pytest.approx(15.0)
        fifth = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0)
        return fifth, waiting, queue

    async def refused():
        fifth, waiting, queue = await scenario(12.0)
        with pytest.raises(QueueWaitError) as error:
            await fifth
        assert error.value.retry_after_s == pytest.approx(15.0) and queue.num_queued == 2
        for task in waiting:
            task.cancel()

    async def queued():
        fifth, waiting, queue = await scenario(20.0)
        assert not fifth.done() and queue.num_queued == 3
        for task in [fifth, *waiting]:
            task.cancel()

    asyncio.run(refused())
    asyncio.run(queued())


def test_without_history_nothing_is_predicted_and_a_waiter_out_of_time_is_refused_then():
    async def scenario():
        queue = AdmissionQueue(max_running=1, max_queued=4, max_queue_wait_s=0.05)
        await queue.acquire()
        assert queue.predicted_wait_s() == 0.0  # no request has ended: no refusal up front
        late = asyncio.create_task(queue.acquire())
        behind = asyncio.create_task(queue.acquire())
        with pytest.raises(QueueWaitError):
            await late
        with pytest.raises(QueueWaitError):
            await behind
        assert queue.num_queued == 0 and queue.num_running == 1  # nothing leaked either way
        queue.release()
        assert queue.num_running == 0

    asyncio.run(scenario())


def test_the_queue_clock_decides_a_slot_freed_after_a_waiters_time_passes_it_by():
    """A slot that frees after a waiter's time is up goes to the next in line, however soon the
    waiter's task would have woken; an admitted request's wait ends when it was admitted, not
    when its task ran again (on a busy event loop, later)."""

    async def scenario():
        now = [0.0]
        queue = AdmissionQueue(max_running=1, max_queued=4, max_queue_wait_s=5.0, clock=lambda: now[0])
        await queue.acquire()
        late = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0)
        now[0] = 4.0
        on_time = asyncio.create_task(queue.acquire())
        await asyncio.sleep(0)
        now[0] = 6.0  # past the first waiter's deadline (5 s), within the second's (9 s)
        queue.release()
        now[0] = 60.0  # the admitted task runs again only now
        with pytest.raises(QueueWaitError):
            await late
        assert await on_time == pytest.approx(2.0) and queue.num_running == 1 and queue.num_queued == 0
        queue.release()
        assert queue.num_running == 0

    asyncio.run(scenario())
