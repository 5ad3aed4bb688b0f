"""One message a step from a replica to each router that follows sequences on it.

A router that read each sequence through a streaming call of its own got one Serve message (a
Ray object and its report) per token and sequence: measured on a 2-core Xeon, the router spent
about 0.65 CPU-ms on each token it received that way (1.0 with the proxy's streamed chunk
out; Serve's proxy 0.55 more), on the cores the engine steps on (docs/benchmarks.md). Here a router opens one
``channel`` call per replica (``duet.router.channels``), and each sequence it follows there
goes through it: what a step gives all of them is one message.

A sequence is attached to a channel by ``attach_to``, a call that lasts while the sequence
streams and answers nothing: Serve counts it as the replica's call in flight, and cancelling it
(its client left) aborts the sequence, as closing its stream did. Its items go through the
channel in order, the last one included, and so does an error that ends it (a failed request,
KV that did not arrive). A replica whose channel nobody reads yet (the ``channel`` call and the
``attach_to`` calls race, and a short sequence may end before its channel's call arrives)
keeps the items until it is read, or ``UNREAD_S`` if nobody ever comes (its router went away).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

UNREAD_S = 60.0


class Channel:
    """The items waiting for one router, as ``(request_id, item)``; ``followers``: sequences
    attached; ``read``: a ``channel`` call reads it."""

    def __init__(self) -> None:
        self._items: list[tuple[str, object]] = []
        self._ready = asyncio.Event()
        self.followers = 0
        self.read = False
        self.served = False  # a ``channel`` call has read it
        self.created = time.monotonic()

    @property
    def waiting(self) -> bool:
        return bool(self._items)

    def put(self, request_id: str, item: object) -> None:
        self._items.append((request_id, item))
        self._ready.set()

    async def batches(self) -> AsyncIterator[list[tuple[str, object]]]:
        """Everything put since the last batch, each time something was. The engine loop hands
        a step's outputs to the event loop in one go, and each sequence's reader puts its item
        before this wakes, so a step is one batch."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            items, self._items = self._items, []
            if items:
                yield items


class Channels:
    """A replica's channels by id (a router names its own)."""

    def __init__(self) -> None:
        self._open: dict[str, Channel] = {}

    def __len__(self) -> int:
        return len(self._open)

    def _get(self, channel_id: str) -> Channel:
        now = time.monotonic()
        for other_id, channel in list(self._open.items()):  # never read, and nobody is coming
            if not (channel.served or channel.read or channel.followers) and now - channel.created > UNREAD_S:
                del self._open[other_id]
        return self._open.setdefault(channel_id, Channel())

    async def serve(self, channel_id: str) -> AsyncIterator[list[tuple[str, object]]]:
        """The ``channel`` call's stream: the channel's batches until the router closes it."""
        channel = self._get(channel_id)
        channel.read = channel.served = True
        try:
            async for batch in channel.batches():
                yield batch
        finally:
            channel.read = False
            self._drop_if_done(channel_id, channel)

    async def feed(self, channel_id: str, request_id: str, items: AsyncIterator) -> None:
        """Put a sequence's ``items`` in the channel until they end; an error that ends them
        goes in last (cancelling this closes ``items``, which aborts the sequence)."""
        channel = self._get(channel_id)
        channel.followers += 1
        try:
            async with aclosing(items):
                async for item in items:
                    channel.put(request_id, item)
        except Exception as error:  # noqa: BLE001 - the sequence's end, for its router, after its tokens
            channel.put(request_id, error)
        finally:
            channel.followers -= 1
            self._drop_if_done(channel_id, channel)

    def _drop_if_done(self, channel_id: str, channel: Channel) -> None:
        """Once no call uses it: unless it holds items its reader has not come for yet (the
        sequences fed it and ended before the ``channel`` call arrived: dropping those lost
        their every token, and their router waited for ever)."""
        if channel.read or channel.followers or self._open.get(channel_id) is not channel:
            return
        if channel.served or not channel.waiting:
            del self._open[channel_id]
