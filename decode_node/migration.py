"""Sequences that move between decode replicas: out of one leaving its pool, into another.

A decode replica leaving its pool while alive (Serve stopping it: scale-down, redeploy) moves
its sequences to the others by KV before it goes: it refuses new sequences and, for each one it
streams, holds it still between two steps, has another replica ``reserve`` blocks for its
tokens so far, ships the KV there and ends the stream with ``Moved``: the router then
``attach``es to the new replica and reads on. A sequence that cannot move by KV (a colocated
pool has no connector; no replica has room in time) ends with ``Moved(None)``: the router
recomputes it elsewhere.

The other replicas are reached through ``Peers``, which the replica host implements over Serve
(``duet.cluster.replica``); nothing here knows Serve.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Protocol

from duet.engine_loop import EngineLoop
from duet.errors import ReplicaGoneError
from duet.messages import EngineRequest, Moved, Placement

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 45.0  # a leaving replica's moves and transfers
ATTACH_TIMEOUT_S = 30.0  # a sequence moved here that no router reads by then is dropped
SHED_MIN_TOKENS = 32
SHED_TRIES = 50  # a sequence shed waits for a moment between two decode steps, this many times 20 ms at most


@dataclasses.dataclass(frozen=True)
class Target:
    """A replica named as a move's destination: its pool and id."""

    pool: str
    replica_id: str


@dataclasses.dataclass
class Stream:
    """A sequence streaming from a replica: what it was asked, where its outputs go."""

    request: EngineRequest
    outputs: asyncio.Queue
    moved_to: str | None = None  # the replica its KV went to, once it has
    moved_pool: str | None = None  # that replica's pool (None: the decode pool)


class Peers(Protocol):
    """The other replicas serving decode: the decode pool's, and those of the prefill pool
    serving decode (``duet.router.roles``), reached by name."""

    async def reserve(self, request: EngineRequest, num_prompt_blocks: int, to: Target | None = None) -> Placement:
        """Blocks reserved on another replica for a sequence moving there: one the decode pool's
        router picks, or the replica ``to`` names (raises if none took it)."""

    def abort(self, request_id: str, replica_id: str, pool: str | None = None) -> None:
        """Free a sequence held on ``replica_id`` of ``pool`` (None: the decode pool; sent, not awaited)."""

    def any_running(self) -> bool:
        """Whether the pool lists running replicas (besides those leaving)."""


class Migration:
    """Both ends of a move on one decode replica, and the placement every sequence takes:
    ``leave`` sends this replica's sequences away; ``adopt`` and ``attach`` take one placed here
    (new, moved or recomputed). ``streams`` is the replica's table of the
    sequences it streams (shared: it adds and removes them as their readers come and go)."""

    def __init__(self, replica_id: str, engine, loop: EngineLoop, streams: dict[str, Stream], peers: Peers, by_kv: bool) -> None:
        self.replica_id = replica_id
        self.engine = engine
        self.loop = loop
        self.streams = streams
        self.peers = peers
        self.by_kv = by_kv  # the pool moves KV (it has a connector); else the router recomputes
        self.adopted: dict[str, Stream] = {}  # moved here; the router has yet to attach

    # -- into this replica

    def adopt(self, stream: Stream) -> None:
        """A sequence placed here (``reserve``), held for its router's ``attach``: it is dropped
        unless one attaches within ``ATTACH_TIMEOUT_S``."""
        self.adopted[stream.request.request_id] = stream

    def attach(self, request_id: str) -> Stream:
        stream = self.adopted.pop(request_id, None)
        if stream is None:
            raise ReplicaGoneError(f"{request_id} is not held on replica {self.replica_id} (dropped, or never moved here)")
        return stream

    def forget(self, request_id: str) -> bool:
        """Stop holding an adopted sequence for a router (aborted); whether it was held."""
        if self.adopted.pop(request_id, None) is None:
            return False
        self.loop.unsubscribe(request_id)
        return True

    async def drop_unless_attached(self, request_id: str) -> None:
        await asyncio.sleep(ATTACH_TIMEOUT_S)
        if self.forget(request_id):
            logger.warning("%s was moved here but no router attached to it in %.0f s; dropping it", request_id, ATTACH_TIMEOUT_S)
            await self.loop.call(self.engine.abort_request, request_id)

    # -- out of this replica

    async def leave(self, stage: str) -> None:
        """Move every sequence away, until none is left here or ``DRAIN_TIMEOUT_S`` passed."""
        logger.info("%s replica %s left its pool: moving its %d sequences", stage, self.replica_id, len(self.streams))
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        # Sequences moved here and not attached yet count too: a router attaches them, then they move on.
        while (self.streams or self.adopted) and time.monotonic() < deadline:
            for request_id in list(self.streams):
                await self.move(request_id, by_kv=self.by_kv and self.peers.any_running())
            await asyncio.sleep(0.02)  # the ones between no two steps yet: after the next

    async def move(self, request_id: str, by_kv: bool, to: Target | None = None) -> bool:
        """Move one sequence off this replica, by KV if it can (else the router recomputes it),
        to the replica ``to`` names (None: one the decode pool's router picks). Whether it left:
        False when it ended meanwhile, or was not between two decode steps (try after the next),
        or, bound for ``to``, did not go there (it stays)."""
        stream = self.streams.get(request_id)
        held = await self.loop.call(self.engine.freeze, request_id)
        if stream is None or held is None:
            return False
        moved_to = None
        if by_kv:
            moved_to = await self._move_by_kv(stream.request, held, to)
        if moved_to is None and to is not None:  # shedding load, not leaving: it goes on here
            await self.loop.call(self.engine.unfreeze, request_id)
            return False
        pool = to.pool if to is not None else None
        if moved_to is None:
            await self.loop.call(self.engine.abort_request, request_id)
        elif request_id not in self.streams:  # its reader left while it moved: no router will attach to it
            self.peers.abort(request_id, moved_to, pool)
        stream.moved_to, stream.moved_pool = moved_to, pool
        stream.outputs.put_nowait(Moved(moved_to, held, pool))
        return True

    async def shed(self, to: Target, count: int) -> int:
        """Move up to ``count`` of this replica's sequences, those with the most tokens still to
        make first, to the replica ``to`` names (one that just took the decode role, while this
        one has more than its share); how many went. A sequence moves so once at most (one
        placed here afresh), and only with ``SHED_MIN_TOKENS`` still to make: a move costs a
        transfer, and counts against the router's ``max_migrations``."""
        def remaining(request_id: str) -> int:
            request = self.engine.scheduler.requests.get(request_id)
            return 0 if request is None else (request.sampling_params.max_tokens or 1 << 30) - request.num_output_tokens

        def candidates() -> list[str]:
            fresh = [request_id for request_id, stream in self.streams.items() if not stream.request.output_token_ids]
            return sorted((request_id for request_id in fresh if remaining(request_id) >= SHED_MIN_TOKENS), key=remaining, reverse=True)

        moved = 0
        for request_id in (await self.loop.call(candidates))[:count]:
            for _ in range(SHED_TRIES):  # between two decode steps: the next, or the one after
                if request_id not in self.streams:
                    break
                if await self.move(request_id, by_kv=self.by_kv, to=to):
                    moved += 1
                    break
                await asyncio.sleep(0.02)
        if moved:
            logger.info("replica %s shed %d sequences to %s replica %s", self.replica_id, moved, to.pool, to.replica_id)
        return moved

    async def _move_by_kv(self, request: EngineRequest, held: list[int], to: Target | None = None) -> str | None:
        """Ship a frozen sequence's KV to another replica; the replica it went to (None: it did not)."""
        request_id = request.request_id
        resumed = dataclasses.replace(request, output_token_ids=held, kv_receive=True)
        num_blocks = -(-(len(request.prompt_token_ids) + len(held)) // self.engine.block_size)
        try:
            placement = await self.peers.reserve(resumed, num_blocks, to)
        except Exception as error:  # noqa: BLE001 - no replica took it: recomputed elsewhere (or stays)
            logger.warning("no decode replica took %s (%r)", request_id, error)
            return None
        if await self.loop.call(self.engine.migrate, request_id, placement.destination):
            logger.info("moved %s to replica %s by KV (%d tokens)", request_id, placement.replica_id, len(request.prompt_token_ids) + len(held))
            return placement.replica_id
        self.peers.abort(request_id, placement.replica_id, to.pool if to is not None else None)  # gone here meanwhile
        return None
