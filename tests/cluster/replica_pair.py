"""Replicas of a pair built from their parts, as the replica tests drive them without Serve:
peers that call the other replica of the pair in this process, and reading a placed
sequence's stream."""

from __future__ import annotations

import asyncio
import time

from duet.cluster.replica import EngineReplica
from duet.messages import EngineRequest, Moved, Placement


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
    """A sequence placed on a replica as the router places one (``reserve``), and its stream (``attach``)."""
    placement = await replica.reserve(request)
    assert placement.replica_id == replica.replica_id
    return replica.attach(request.request_id, replica.replica_id)


async def read_stream(stream) -> tuple[list[int], Moved | None]:
    """A replica's stream read to its end: the tokens it streamed, and the move that ended it, if one did."""
    token_ids = []
    async for item in stream:
        if isinstance(item, Moved):
            return token_ids, item
        token_ids += item.token_ids
    return token_ids, None
