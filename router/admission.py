"""Admission control, counted in sequences: a request runs once its sequences (prompts x ``n``)
fit under ``max_running`` (one with more than that runs alone), up to ``max_queued`` requests
wait in arrival order behind, and the rest are refused at once (HTTP 429 with Retry-After)."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque


class QueueFullError(RuntimeError):
    """The admission queue is full."""


class AdmissionQueue:
    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.num_running = 0  # sequences
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()

    @property
    def num_queued(self) -> int:
        """Requests waiting (whatever their number of sequences)."""
        return len(self._waiters)

    def _cost(self, num_sequences: int) -> int:
        return min(num_sequences, self.max_running)

    async def acquire(self, num_sequences: int = 1) -> float:
        """Admit a request of ``num_sequences``, waiting in line if need be; returns the seconds
        waited. Every successful ``acquire`` must be matched by a ``release`` of the same size."""
        arrival = time.monotonic()
        cost = self._cost(num_sequences)
        if not self._waiters and self.num_running + cost <= self.max_running:
            self.num_running += cost
            return 0.0
        if len(self._waiters) >= self.max_queued:
            raise QueueFullError(f"{self.num_running} sequences running and {len(self._waiters)} requests queued; retry later")
        entry = (asyncio.get_running_loop().create_future(), cost)
        self._waiters.append(entry)
        try:
            await entry[0]  # ``_admit_waiters`` counts the request in before waking it
        except asyncio.CancelledError:
            if entry[0].done() and not entry[0].cancelled():
                self.release(num_sequences)
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._admit_waiters()  # it may have held back smaller requests behind it
            raise
        return time.monotonic() - arrival

    def release(self, num_sequences: int = 1) -> None:
        self.num_running -= self._cost(num_sequences)
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        """Admit waiting requests, oldest first, while the oldest fits (no overtaking: a large
        request is not starved by small ones behind it)."""
        while self._waiters:
            waiter, cost = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            if self.num_running + cost > self.max_running:
                return
            self._waiters.popleft()
            self.num_running += cost
            waiter.set_result(None)


class Admitted:
    """A request's admission, given back exactly once: by ``release()`` when it ends, or, should
    the request be dropped without ending (a stream the client left before it began), when this
    object is collected."""

    def __init__(self, queue: AdmissionQueue, num_sequences: int) -> None:
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                queue.release(num_sequences)

        self.release = release
        weakref.finalize(self, release)
