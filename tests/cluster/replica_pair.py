"""Replicas of a pair built from their parts, as the replica tests drive them without Serve:
peers that call the other replica of the pair in this process, and reading a placed
sequence's stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from duet.cluster.replica import EngineReplica
from duet.messages import EngineRequest, Moved, Placement, TokenDelta


class DirectPeers:
    """``decode_node.migration.Peers`` of one replica of a pair: the other, called in this process."""

    def __init__(self) -> None:
        self.other: EngineReplica | None = None

    async def reserve(self, request: EngineRequest, num_prompt_blocks: int, to=None) -> Placement:
        assert to is None or to.replica_id == self.other.replica_id
        return await self.other.reserve(request, num_prompt_blocks)

    def abort(self, request_id: str, replica_id: str, pool: str | None = None) -> None:
        asyncio.ensure_future(self.other.abort(request_id, replica_id))

    def any_running(self) -> bool:
        return True


async def settled(replica: EngineReplica, within_s: float = 20.0) -> tuple[dict, int]:
    """The replica's sequences and free blocks once it holds none (or as they are at the deadline)."""
    engine = replica.engine
    deadline = time.monotonic() + within_s
    while True:
        state = await replica.loop.call(lambda: (dict(engine.scheduler.requests), engine.kv_cache_manager.num_free_blocks))
        if state == ({}, engine.num_blocks) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)


async def placed(replica: EngineReplica, request: EngineRequest):
    """A sequence placed on a replica as the router places one (``reserve``), and its stream."""
    placement = await replica.reserve(request)
    assert placement.replica_id == replica.replica_id
    return attached(replica, request.request_id)


async def attached(replica: EngineReplica, request_id: str, replica_id: str | None = None) -> AsyncIterator[TokenDelta | Moved]:
    """A sequence placed on ``replica`` read as a router reads it: ``attach_to`` through a
    channel of its own (``channel``), its items until the last, an error that ends it raised
    (also one of the ``attach_to`` call itself: a sequence not held there). Closing it before
    the end cancels ``attach_to``, which aborts the sequence. ``replica_id``: the id the calls
    name (the replica's own by default)."""
    channel_id = f"test-{request_id}"
    reader = replica.channel(channel_id, replica.replica_id)
    feed = asyncio.ensure_future(replica.attach_to(request_id, replica_id or replica.replica_id, channel_id))
    try:
        while True:
            batch = asyncio.ensure_future(anext(reader))
            await asyncio.wait({batch, feed}, return_when=asyncio.FIRST_COMPLETED)
            if not batch.done() and feed.exception() is not None:  # the call failed before it put anything
                batch.cancel()
                raise feed.exception()
            for item_id, item in await batch:
                assert item_id == request_id
                if isinstance(item, Exception):
                    raise item
                yield item
                if isinstance(item, Moved) or item.finished:
                    return
    finally:
        if not feed.done():
            feed.cancel()
        await reader.aclose()


async def read_stream(stream) -> tuple[list[int], Moved | None]:
    """A replica's stream read to its end: the tokens it streamed, and the move that ended it, if one did."""
    token_ids = []
    async for item in stream:
        if isinstance(item, Moved):
            return token_ids, item
        token_ids += item.token_ids
    return token_ids, None
