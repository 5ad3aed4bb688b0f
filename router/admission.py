"""Admission control: at most ``max_running`` requests in the pools, ``max_queued`` waiting in
order behind them, and the rest refused at once (HTTP 429 with Retry-After)."""

from __future__ import annotations

import asyncio
import time
from collections import deque


class QueueFullError(RuntimeError):
    """The admission queue is full."""


class AdmissionQueue:
    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.num_running = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> float:
        """Take a running slot, waiting in line if need be; returns the seconds waited.
        Every successful ``acquire`` must be matched by one ``release``."""
        arrival = time.monotonic()
        if self.num_running < self.max_running and not self._waiters:
            self.num_running += 1
            return 0.0
        if len(self._waiters) >= self.max_queued:
            raise QueueFullError(f"{self.num_running} requests running and {len(self._waiters)} queued; retry later")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # a releasing request hands its slot over
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise
        return time.monotonic() - arrival

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.num_running -= 1
