"""A pool handle's ``channel`` and ``attach_to`` calls answered in this process by the replica's
own end of the channels (``duet.decode_node.channel``), fed by a test's scripted streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from duet.decode_node.channel import Channels


class StreamCall:
    """A Serve streaming call played in this process."""

    def __init__(self, items: AsyncIterator) -> None:
        self._items = items
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await anext(self._items)

    def cancel(self) -> None:
        self.cancelled = True


class Call:
    """A Serve call played as a task of this event loop."""

    def __init__(self, coroutine) -> None:
        self._task = asyncio.ensure_future(coroutine)

    def __await__(self):
        return self._task.__await__()

    def cancel(self) -> None:
        self._task.cancel()


class _Remote:
    def __init__(self, call) -> None:
        self.remote = call


class ChannelEnd:
    """``play(request_id, replica_id)``: a sequence's items as its replica streams them (an
    exception among them ends it, as the engine's errors do). Each replica id has channels of
    its own; ``hosts`` holds them, to look at."""

    def __init__(self, play: Callable[[str, str], AsyncIterator]) -> None:
        self.hosts: dict[str, Channels] = {}
        self._play = play
        self.channel = _Remote(lambda channel_id, replica_id: StreamCall(self._host(replica_id).serve(channel_id)))
        self.attach_to = _Remote(self._attach_to)

    def _host(self, replica_id: str) -> Channels:
        return self.hosts.setdefault(replica_id, Channels())

    def _attach_to(self, request_id: str, replica_id: str, channel_id: str) -> Call:
        return Call(self._host(replica_id).feed(channel_id, request_id, _raising(self._play(request_id, replica_id))))


async def _raising(items) -> AsyncIterator:
    async for item in items:
        if isinstance(item, Exception):
            raise item
        yield item
