"""Contexts waiting in the router for a pool with room for them, holding no KV anywhere.

The balancer says where a context goes, or that it should wait (``StageBalancer.choose``). The
waiting ones are admitted the most urgent first (``StageBalancer.admit``): one waiting context
asks for all of them every ``WAIT_POLL_S``, and each new one asks on arrival; an admitted context
wakes at once. A context waits at most ``ROOM_WAIT_S``, then the client gets a 503. What waits
is demand: the router reports it to the autoscalers (``demand``), so a pool with room to grow
grows for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Sequence
from contextlib import suppress

from duet.errors import PoolUnavailableError
from duet.router.balance import Choice, StageBalancer

# A sequence no replica has room for (KV reserved for prompts queued on prefill, full batches)
# waits for room this long before a 503.
ROOM_WAIT_S = 60.0
WAIT_POLL_S = 0.05  # how often the first waiting context asks again for all of them


@dataclasses.dataclass(eq=False)
class _Waiting:
    num_tokens: int
    since: float
    prefix_hashes: Sequence[int] = ()
    choice: Choice | None = None
    admitted: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class WaitingRoom:
    def __init__(self, balancer: StageBalancer) -> None:
        self.balancer = balancer
        self.contexts_waited = 0  # contexts the balancer made wait for room in either pool
        self._waiting: list[_Waiting] = []  # first come first

    async def choose(self, num_tokens: int, prefix_hashes: Sequence[int] = ()) -> Choice:
        """The balancer's choice for a context (``prefix_hashes``: its routing hashes), waiting
        while it says wait."""
        waiting = _Waiting(num_tokens, time.monotonic(), prefix_hashes)
        self._waiting.append(waiting)
        try:
            deadline = waiting.since + ROOM_WAIT_S
            for attempt in itertools.count():
                if attempt == 0 or self._waiting[0] is waiting:  # one context asks for all of them
                    self.admit()
                if waiting.choice is not None:
                    choice, waiting.choice = waiting.choice, None
                    return choice
                self.contexts_waited += attempt == 0
                if time.monotonic() >= deadline:
                    raise PoolUnavailableError(f"neither pool had room for this request for {ROOM_WAIT_S:.0f} s; retry it")
                with suppress(TimeoutError):
                    async with asyncio.timeout(WAIT_POLL_S):
                        await waiting.admitted.wait()
        finally:
            self._waiting.remove(waiting)
            if waiting.choice is not None:  # admitted, but its client left before it heard
                waiting.choice.done()

    def demand(self) -> int:
        """The context tokens waiting for a choice: demand no pool's queue shows, which the
        autoscalers count (``duet.cluster.autoscale``)."""
        return sum(waiting.num_tokens for waiting in list(self._waiting) if waiting.choice is None)

    def admit(self) -> None:
        """Hand the waiting contexts the balancer's choices, the most urgent first."""
        now = time.monotonic()
        pending = [waiting for waiting in self._waiting if waiting.choice is None]
        choices = self.balancer.admit([(waiting.num_tokens, now - waiting.since, waiting.prefix_hashes) for waiting in pending])
        for waiting, choice in zip(pending, choices):
            if choice is not None:
                waiting.choice = choice
                waiting.admitted.set()
