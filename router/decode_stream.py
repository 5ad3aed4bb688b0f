"""One sequence's stream from a decode replica (``duet.router.pd`` runs it): placed by
``reserve``, read through the router's channel from that replica (``duet.router.channels``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError

from duet.block_pool import routing_block_hashes
from duet.errors import PoolUnavailableError, ReplicaFullError, ReplicaGoneError
from duet.messages import EngineRequest, Moved, Placement, TokenDelta
from duet.router.balance import Choice
from duet.router.serve_internals import new_call_context
from duet.router.waiting import ROOM_WAIT_S

# The longest a placement waits for a decode replica's answer, room waits (backing off up to a
# second at a time) included.
PLACE_WAIT_S = ROOM_WAIT_S + 10.0


async def _failure_to(queue: asyncio.Queue, call) -> None:
    """An ``attach_to`` call's error, for its sequence's reader (its items say when it ends)."""
    try:
        await call
    except Exception as error:  # noqa: BLE001 - the reader raises it
        queue.put_nowait(error)


def pin(replica_id: str | None) -> dict:
    return {} if replica_id is None else {"replica_id": replica_id}


class DecodeStream:
    """One sequence's stream from a decode replica, placed the one way every sequence is:
    ``place()`` has a replica ``reserve`` it (a full or leaving replica sends it to another) and
    answers where it runs (and its KV destination); iterating reads it there (``attach_to``, its
    items through the router's channel). A sequence moved there by KV (``replica_id`` given) is
    read at once. Iterating gives its deltas, and a final ``Moved`` if it leaves that replica;
    the first delta settles the balancer's ``choice``. Closing it before it finished cancels it, and aborts the sequence
    there. ``pool``: the pool of the replica (placing it may choose a replica serving decode
    away from its pool; a sequence moved by KV says where it went)."""

    def __init__(
        self,
        orchestrator,  # duet.router.pd.Orchestrator
        request: EngineRequest,
        num_prompt_blocks: int = 0,
        replica_id: str | None = None,
        choice: Choice | None = None,
        pool: str | None = None,
        avoid: str | None = None,
    ):
        self.orchestrator = orchestrator
        self.request = request
        self.num_prompt_blocks = num_prompt_blocks
        self.avoid = avoid  # the replica sending its KV (its pool's router places it elsewhere where it can)
        self.replica_id = replica_id
        self.choice = choice
        self.pool = pool or orchestrator.decode_pool
        self.finished = False
        self._call = None  # the reservation in flight
        self._stream = None
        self._watch: asyncio.Future | None = None
        self._items = self._attach()
        orchestrator.open_streams.add(self)

    def headed_to(self) -> str | None:
        """The replica it runs on, or, while it is placed, the one its choice holds it for
        first (where its history is; None: where the pool's router places it)."""
        if self.replica_id is not None or self.choice is None or self.choice.holder is None:
            return self.replica_id
        return self.choice.holder.replica_id

    async def place(self) -> Placement:
        """Where the sequence runs. Bounded: while Serve lists no replica of the pool (its last one
        died and the next is not up, or none can be placed), a call waits in Serve's queue
        without limit, its client's admission held."""
        try:
            async with asyncio.timeout(PLACE_WAIT_S):
                placement = await self._reserve()
        except TimeoutError:
            raise PoolUnavailableError(f"no decode replica took this request in {PLACE_WAIT_S:.0f} s; retry it") from None
        self.replica_id = placement.replica_id
        return placement

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenDelta | Moved:
        item = await anext(self._items)
        if self.choice is not None:
            self.choice.done(first_token=isinstance(item, TokenDelta))
        self.finished = isinstance(item, Moved) or item.finished
        if self.finished:
            self.orchestrator.open_streams.discard(self)
        return item

    def _prefix_hashes(self) -> list[int] | None:
        """The routing hashes of a context the replica computes itself (colocated, or prefilled
        there), for its pool's router to send it where its history is; None for KV received."""
        request = self.request
        if request.kv_receive:
            return None
        return routing_block_hashes(request.prompt_token_ids, self.orchestrator.block_size, request.lora, request.lora_path)

    async def _reserve(self) -> Placement:
        deadline = time.monotonic() + ROOM_WAIT_S
        refused = 0
        prefix_hashes = self._prefix_hashes()  # once: the same for every attempt
        holder = self.choice.holder if self.choice is not None else None  # first where its history is
        while True:
            first, holder = holder, None
            pool, pinned = (first.pool, first.replica_id) if first is not None else self.orchestrator.targets.decode()
            if pool is None:
                self.orchestrator.roles.want()
            else:
                new_call_context()  # an abort of an earlier placement may still be on its way
                handle = self.orchestrator.handles[pool]
                self._call = handle.reserve.remote(
                    self.request, num_prompt_blocks=self.num_prompt_blocks, lora=self.request.lora, prefix_hashes=prefix_hashes,
                    **pin(pinned), **({"avoid": self.avoid} if self.avoid else {})
                )
                try:
                    placement = await self._call
                except (ReplicaFullError, ReplicaGoneError):  # full, leaving, serving prefill now; pinned: gone
                    if first is not None:
                        continue  # the pool's router places it next, at once: it knows which replicas have room
                    refused += 1
                except RayActorError:
                    if first is None:
                        raise
                    self.orchestrator.held.forget(first.replica_id)  # where its history was died, and the history with it
                    continue
                else:
                    self._call = None
                    self.pool = pool
                    return placement
            if time.monotonic() >= deadline:
                raise PoolUnavailableError(f"no decode replica had room for this request for {ROOM_WAIT_S:.0f} s; retry it") from None
            # Backing off from full replicas; a role about to be taken, within a planning round.
            await asyncio.sleep(min(1.0, 0.05 * 2 ** (refused - 1)) if pool is not None else 0.05)

    async def _attach(self) -> AsyncIterator[TokenDelta | Moved]:
        """Its items through the router's channel from its replica (``duet.router.channels``);
        the ``attach_to`` call lasts as long, and answers only an error that ends it first."""
        channels, request_id, replica_id = self.orchestrator.channels, self.request.request_id, self.replica_id
        channel_id, queue = channels.follow(self.pool, replica_id, request_id)
        try:
            new_call_context()
            self._stream = self.orchestrator.handles[self.pool].attach_to.remote(request_id, replica_id=replica_id, channel_id=channel_id)
            self._watch = asyncio.ensure_future(_failure_to(queue, self._stream))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Moved) or item.finished:
                    channels.leave(replica_id, channel_id, request_id)  # its reader may stop at this one
                    yield item
                    return
                yield item
        finally:
            channels.leave(replica_id, channel_id, request_id)

    async def aclose(self) -> None:
        self.orchestrator.open_streams.discard(self)
        if self.choice is not None:
            self.choice.done()
        await self._items.aclose()  # off its channel, wherever its reader stopped
        if self.finished:
            return
        self.finished = True
        for call in (self._call, self._stream):
            if call is not None:
                call.cancel()
        if self.replica_id is not None:
            replica_id, request_id, handle = self.replica_id, self.request.request_id, self.orchestrator.handles[self.pool]
            self.orchestrator.fire(self.pool, replica_id, lambda: handle.abort.remote(request_id, replica_id=replica_id))
