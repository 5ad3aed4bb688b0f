"""A router's channels: one stream from each replica it follows sequences on, whose batches
(a step's items for all of them) it hands to each sequence's queue (``duet.decode_node.channel``
is the replica's end, and says why).

``follow`` gives a sequence its queue on the replica's channel, opening the channel if none is
open; ``leave`` takes it off. A channel without followers for ``LINGER_S`` is closed, so that a
replica Serve stops is not held by it and a light load does not open one per sequence. When a
channel ends (its replica died or left, the call failed) every sequence still on it gets
``ReplicaGoneError``: the router recomputes it elsewhere from its tokens so far.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os

from ray.exceptions import RayActorError

from duet.errors import ReplicaGoneError

logger = logging.getLogger(__name__)

LINGER_S = 2.0


class _Open:
    """One open channel: its id (the replica's key for it), the call reading it, and the queue of
    each sequence following it."""

    def __init__(self, channel_id: str) -> None:
        self.channel_id = channel_id
        self.followers: dict[str, asyncio.Queue] = {}
        self.call = None
        self.task: asyncio.Task | None = None
        self.closing: asyncio.TimerHandle | None = None


class Channels:
    """``handles``: the pools' Serve handles by name; ``new_call_context``: gives the next call a
    request context of its own (``duet.router.serve_internals``)."""

    def __init__(self, handles: dict, new_call_context) -> None:
        self._handles = handles
        self._new_call_context = new_call_context
        self._ids = (f"{os.getpid()}-{id(self):x}-{n}" for n in itertools.count())
        self._open: dict[str, _Open] = {}  # by replica id
        self.opened = 0
        self.messages = 0  # read from every channel; each carries a step's items (``items``)
        self.items = 0

    def follow(self, pool: str, replica_id: str, request_id: str) -> tuple[str, asyncio.Queue]:
        """The channel id to attach ``request_id`` with, and the queue its items come to."""
        channel = self._open.get(replica_id)
        if channel is None:
            channel = self._open[replica_id] = _Open(next(self._ids))
            channel.task = asyncio.get_running_loop().create_task(self._read(pool, replica_id, channel))
            self.opened += 1
        if channel.closing is not None:
            channel.closing.cancel()
            channel.closing = None
        queue: asyncio.Queue = asyncio.Queue()
        channel.followers[request_id] = queue
        return channel.channel_id, queue

    def leave(self, replica_id: str, channel_id: str, request_id: str) -> None:
        channel = self._open.get(replica_id)
        if channel is None or channel.channel_id != channel_id:
            return
        channel.followers.pop(request_id, None)
        if not channel.followers and channel.closing is None:
            channel.closing = asyncio.get_running_loop().call_later(LINGER_S, self._close_if_idle, replica_id, channel)

    def _close_if_idle(self, replica_id: str, channel: _Open) -> None:
        channel.closing = None
        if channel.followers or self._open.get(replica_id) is not channel:
            return
        del self._open[replica_id]
        if channel.call is not None:
            channel.call.cancel()
        channel.task.cancel()

    async def _read(self, pool: str, replica_id: str, channel: _Open) -> None:
        error: BaseException | None = None
        try:
            self._new_call_context()
            channel.call = self._handles[pool].options(stream=True).channel.remote(channel.channel_id, replica_id=replica_id)
            async for batch in channel.call:
                self.messages += 1
                self.items += len(batch)
                for request_id, item in batch:
                    queue = channel.followers.get(request_id)
                    if queue is not None:
                        queue.put_nowait(item)
        except asyncio.CancelledError:
            if channel.followers:  # cancelled with sequences on it: this router is closing
                error = ReplicaGoneError(f"the channel from replica {replica_id} was closed")
            raise
        except Exception as failure:  # noqa: BLE001 - every sequence on it hears of it
            error = failure
        finally:
            if self._open.get(replica_id) is channel:
                del self._open[replica_id]
            if channel.followers:
                if error is None:
                    error = ReplicaGoneError(f"replica {replica_id} closed its channel")
                logger.warning("channel from replica %s ended under %d sequences: %r", replica_id, len(channel.followers), error)
                if not isinstance(error, (RayActorError, ReplicaGoneError)):  # recomputed elsewhere, as a replica lost
                    error = ReplicaGoneError(f"the channel from replica {replica_id} failed: {error!r}")
                for queue in channel.followers.values():
                    queue.put_nowait(error)
