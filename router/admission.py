"""Admission control, counted in sequences: a request runs once its sequences (prompts x ``n``)
fit under ``max_running`` (one with more than that runs alone), up to ``max_queued`` requests
wait in arrival order behind, and the rest are refused at once (HTTP 429 with Retry-After).

With ``max_queue_wait_s``, no request waits longer than that: one that would is refused at
once (HTTP 503 with Retry-After), rather than after waiting in vain. Its wait is predicted by
Little's law from how long admitted requests have held their slots lately: the slots that must
free up before it fits (running and queued ahead, plus its own, over ``max_running``) times the
mean hold over ``max_running``. A prediction is an estimate: a request still waiting when its
time is up is refused then, with the same status. Both are decided on the queue's own clock:
slots that free after a waiter's time is up pass it by, however late its task wakes (a busy
event loop), and the wait a request reports ends when it was admitted, not when it woke.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque

# Holds remembered for the prediction, and how many before it is trusted.
HOLD_HISTORY = 64
MIN_HOLDS = 4


class QueueFullError(RuntimeError):
    """The admission queue is full (HTTP 429)."""


class QueueWaitError(RuntimeError):
    """The request would wait, or has waited, longer than ``max_queue_wait_s`` (HTTP 503);
    ``retry_after_s``: when the queue is expected to have room."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AdmissionQueue:
    def __init__(self, max_running: int, max_queued: int, max_queue_wait_s: float | None = None, clock=time.monotonic) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_queue_wait_s = max_queue_wait_s
        self.clock = clock
        self.num_running = 0  # sequences
        # (woken with the admission time, or None once out of time; sequences; deadline)
        self._waiters: deque[tuple[asyncio.Future, int, float | None]] = deque()
        self._holds: deque[float] = deque(maxlen=HOLD_HISTORY)  # seconds recent requests held their slots

    def predicted_wait_s(self, num_sequences: int = 1) -> float:
        """Seconds a request of ``num_sequences`` arriving now would wait for admission (0 while
        fewer than ``MIN_HOLDS`` requests have ended: nothing to predict from)."""
        if len(self._holds) < MIN_HOLDS:
            return 0.0
        queued = sum(cost for waiter, cost, _ in self._waiters if not waiter.done())
        to_free = self.num_running + queued + self._cost(num_sequences) - self.max_running
        return max(0, to_free) * (sum(self._holds) / len(self._holds)) / self.max_running

    @property
    def num_queued(self) -> int:
        """Requests waiting (whatever their number of sequences)."""
        return len(self._waiters)

    def _cost(self, num_sequences: int) -> int:
        return min(num_sequences, self.max_running)

    async def acquire(self, num_sequences: int = 1) -> float:
        """Admit a request of ``num_sequences``, waiting in line if need be; returns the seconds
        waited. Every successful ``acquire`` must be matched by a ``release`` of the same size."""
        arrival = self.clock()
        cost = self._cost(num_sequences)
        if not self._waiters and self.num_running + cost <= self.max_running:
            self.num_running += cost
            return 0.0
        if len(self._waiters) >= self.max_queued:
            raise QueueFullError(f"{self.num_running} sequences running and {len(self._waiters)} requests queued; retry later")
        limit = self.max_queue_wait_s
        if limit is not None and (predicted := self.predicted_wait_s(num_sequences)) > limit:
            raise QueueWaitError(
                f"it would wait about {predicted:.0f} s for admission, over router.max_queue_wait_s={limit:g}; retry later", predicted
            )
        entry = (asyncio.get_running_loop().create_future(), cost, None if limit is None else arrival + limit)
        self._waiters.append(entry)
        try:
            # ``_admit_waiters`` counts the request in before waking it
            await asyncio.wait([entry[0]], timeout=limit)
            if not entry[0].done():
                self._withdraw(entry)
            admitted_at = entry[0].result() if entry[0].done() else None
            if admitted_at is None:
                raise QueueWaitError(
                    f"it waited router.max_queue_wait_s={limit:g} s without being admitted; retry later",
                    max(1.0, self.predicted_wait_s(num_sequences)),
                )
        except asyncio.CancelledError:
            if entry[0].done() and not entry[0].cancelled() and entry[0].result() is not None:
                self.release(num_sequences)
            elif entry in self._waiters:
                self._withdraw(entry)
            raise
        return admitted_at - arrival

    def _withdraw(self, entry: tuple[asyncio.Future, int, float | None]) -> None:
        """Take a waiting request out of the line."""
        self._waiters.remove(entry)
        self._admit_waiters()  # it may have held back smaller requests behind it

    def release(self, num_sequences: int = 1, held_s: float | None = None) -> None:
        """Give back a request's slots; ``held_s``: how long it held them (for the prediction)."""
        self.num_running -= self._cost(num_sequences)
        if held_s is not None:
            self._holds.append(held_s)
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        """Admit waiting requests, oldest first, while the oldest fits (no overtaking: a large
        request is not starved by small ones behind it); one whose time is up is woken out of
        the line instead, unadmitted."""
        now = self.clock()
        while self._waiters:
            waiter, cost, deadline = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if deadline is not None and now > deadline:
                self._waiters.popleft()
                waiter.set_result(None)
                continue
            if self.num_running + cost > self.max_running:
                return
            self._waiters.popleft()
            self.num_running += cost
            waiter.set_result(now)


class Admitted:
    """A request's admission, given back exactly once: by ``release()`` when it ends, or, should
    the request be dropped without ending (a stream the client left before it began), when this
    object is collected."""

    def __init__(self, queue: AdmissionQueue, num_sequences: int) -> None:
        released = []
        admitted_at = queue.clock()

        def release() -> None:
            if not released:
                released.append(True)
                queue.release(num_sequences, queue.clock() - admitted_at)

        self.release = release
        weakref.finalize(self, release)
