"""The one Serve deployment class of every pool: an engine stepped by an ``EngineLoop``,
configured by its role (``prefill_node.role``, ``decode_node.role``).

``generate`` streams one sequence: on a decode (or colocated) replica first a ``Placement``
(its replica, and for a ``kv_receive`` request the ``KVDestination`` of the blocks it reserved),
then ``TokenDelta``s; a prefill replica's stream is its first token. Calls that name a
``replica_id`` (``abort``, ``attach``, ``expect_kv``, ``check_integrity``) are pinned to that
replica (see ``duet.router.routing``).

A decode replica leaving its pool while alive (Serve stopping it: scale-down, redeploy) moves
its sequences to the others by KV before it goes: it watches its own pool through a handle of
its own, and when its id leaves the pool's replica set it refuses new sequences and, for each
one it streams, holds it still between two steps, has another replica ``reserve`` blocks for
its tokens so far, ships the KV there and ends the stream with ``Moved``: the router then
``attach``es to the new replica and reads on. A sequence that cannot move by KV (a colocated
pool has no connector; no replica has room in time) ends with ``Moved(None)``: the router
recomputes it elsewhere. A leaving prefill replica finishes what it has (Serve routes nothing
new to it) and its transfers before its engine closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import torch
from ray import serve

from duet.block_pool import BlockIntegrityError
from duet.cluster.autoscale import autoscaling_metrics
from duet.cluster.loopback import keep_replica_on_loopback
from duet.config import EngineArgs
from duet.decode_node.role import DecodeRole
from duet.engine import LLMEngine
from duet.engine_loop import EngineLoop
from duet.errors import KVTransferFailedError, ReplicaFullError, ReplicaGoneError, RequestFailedError
from duet.messages import EngineRequest, KVDestination, Moved, Placement, ReplicaStats, TokenDelta
from duet.prefill_node.role import PrefillRole
from duet.router.routing import own_serve_request, replica_ids, watch_departure

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")
# Serve waits this long for a stopped replica's calls to end before killing it (its default, 20
# s, cuts long streams; here they move away, so it is rarely reached).
GRACEFUL_SHUTDOWN_TIMEOUT_S = 60.0
# Serve probes each replica this often (its default is 10 s): one whose worker died is found,
# and replaced, within seconds.
HEALTH_CHECK_PERIOD_S = 2.0
DRAIN_TIMEOUT_S = 45.0  # a leaving replica's moves and transfers, within the above
ATTACH_TIMEOUT_S = 30.0  # a sequence moved here that no router reads by then is dropped
MOVE_CALL_TIMEOUT_S = 10.0


@dataclasses.dataclass
class _Stream:
    """A sequence streaming from this replica: what it was asked, where its outputs go."""

    request: EngineRequest
    outputs: asyncio.Queue
    moved_to: str | None = None  # the replica its KV went to, once it has


class EngineReplica:
    """``role``: prefill, decode or colocated. ``kv_transfer``: the KV connector's settings
    (``KVTransferConfig`` fields but ``name``, which is the replica id), None when colocated."""

    def __init__(self, role: str, engine_args: dict, num_threads: int, kv_transfer: dict | None = None) -> None:
        keep_replica_on_loopback()
        torch.set_num_threads(num_threads)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.role = PrefillRole() if role == "prefill" else DecodeRole(colocated=role == "colocated")
        args = self.role.engine_args(engine_args)
        if kv_transfer is not None:
            args = args | {"kv_transfer_config": kv_transfer | {"name": self.replica_id}}
        self.engine = LLMEngine(EngineArgs(**args))
        self.integrity_failures = 0
        self.loop = EngineLoop(
            self.engine.step, _request_id, self.engine.has_unfinished_requests, name=f"{role}-loop", on_idle=self._check_when_idle
        )
        self.draining = False
        self._streams: dict[str, _Stream] = {}
        self._adopted: dict[str, _Stream] = {}  # moved here; the router has yet to attach
        self._tasks: set[asyncio.Task] = set()
        if self.role.stage != "prefill":
            # A handle on its own pool: its router in this process sees the replica set change
            # (this replica leaving it) and sends the moves' reservations to the others.
            self._pool = serve.get_deployment_handle(context.deployment, context.app_name).options(stream=False)
            self._spawn(self._leave_when_departed(watch_departure(self.replica_id)))
        logger.info("%s replica %s ready with %d threads", role, self.replica_id, num_threads)

    async def generate(
        self, request: EngineRequest, prefix_hashes: list[int] | None = None, num_prompt_blocks: int = 0
    ) -> AsyncIterator[Placement | TokenDelta | Moved]:
        """Stream one sequence; it is aborted in the engine however the stream ends early.
        ``prefix_hashes`` and ``num_prompt_blocks`` are hints for the pools' request routers."""
        self._refuse_new_sequences()
        self.role.admit(request, self.engine.block_size)
        stream, destination = await self._add(request)
        if self.role.stage != "prefill":
            try:
                yield Placement(self.replica_id, destination)
            except BaseException:  # closed before following it: a router cancelled before reading where it runs
                self.loop.unsubscribe(request.request_id)
                self.loop.call_soon(self.engine.abort_request, request.request_id)
                raise
        async with aclosing(self._follow(stream)) as items:
            async for item in items:
                yield item

    async def reserve(self, request: EngineRequest, num_prompt_blocks: int = 0) -> Placement:
        """Take a sequence moving here by KV from a leaving replica: reserve blocks for its
        tokens so far and answer where to send them. Its outputs wait for ``attach``."""
        self._refuse_new_sequences()
        stream, destination = await self._add(request)
        self.loop.call_soon(self.engine.expect_kv, request.request_id)  # its KV is computed: it ships at once
        self._adopted[request.request_id] = stream
        self._spawn(self._drop_unless_attached(request.request_id))
        return Placement(self.replica_id, destination)

    async def _add(self, request: EngineRequest) -> tuple[_Stream, KVDestination | None]:
        """Subscribe to the sequence's outputs and add it to the engine: its stream, and where
        its KV is to be sent when it comes from elsewhere."""
        if request.params.structured_outputs is not None:  # its slow first checks, off the engine thread
            await asyncio.to_thread(self.engine.check_constraint, request.params)
        stream = _Stream(request, self.loop.subscribe(request.request_id))
        try:
            return stream, await self.loop.call(self.engine.add_request, request)
        except Exception:  # refused: it never joined the engine
            self.loop.unsubscribe(request.request_id)
            raise
        except BaseException:  # cancelled: the engine adds it all the same, then this aborts it
            self.loop.unsubscribe(request.request_id)
            self.loop.call_soon(self.engine.abort_request, request.request_id)
            raise

    async def attach(self, request_id: str, replica_id: str) -> AsyncIterator[TokenDelta | Moved]:
        """Stream a sequence moved here by ``reserve``, from its first token made here."""
        ReplicaGoneError.check(replica_id, self.replica_id)
        stream = self._adopted.pop(request_id, None)
        if stream is None:
            raise ReplicaGoneError(f"{request_id} is not held on replica {self.replica_id} (dropped, or never moved here)")
        async with aclosing(self._follow(stream)) as items:
            async for item in items:
                yield item

    async def _follow(self, stream: _Stream) -> AsyncIterator[TokenDelta | Moved]:
        request_id = stream.request.request_id
        self._streams[request_id] = stream
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, Moved):
                    finished = True
                    yield item
                    return
                finished = item.finished
                if item.error is not None:
                    raise (KVTransferFailedError if item.kv_lost else RequestFailedError)(item.error)
                yield item
        finally:
            self._streams.pop(request_id, None)
            self.loop.unsubscribe(request_id)
            if not finished:
                self.loop.call_soon(self.engine.abort_request, request_id)
                if stream.moved_to is not None:  # closed before its reader heard of the move
                    self._abort_moved(request_id, stream.moved_to)

    async def expect_kv(self, request_id: str, replica_id: str) -> None:
        """The prefill replica computing this sequence's KV has answered: its transfer should
        start now, and is given up (the router recomputes the sequence) if no worker reports on
        it within the engine's receive deadline."""
        ReplicaGoneError.check(replica_id, self.replica_id)
        await self.loop.call(self.engine.expect_kv, request_id)

    async def abort(self, request_id: str, replica_id: str) -> None:
        ReplicaGoneError.check(replica_id, self.replica_id)
        if self._adopted.pop(request_id, None) is not None:
            self.loop.unsubscribe(request_id)
        await self.loop.call(self.engine.abort_request, request_id)

    def _refuse_new_sequences(self) -> None:
        if self.draining:
            raise ReplicaFullError(f"replica {self.replica_id} is leaving its pool")
        if self.engine.worker_failure is not None:  # its health check fails: Serve replaces it
            raise ReplicaFullError(f"replica {self.replica_id} lost a worker ({self.engine.worker_failure})")

    # -- leaving the pool

    async def _leave_when_departed(self, departed: asyncio.Event) -> None:
        await departed.wait()
        self.draining = True
        logger.info("%s replica %s left its pool: moving its %d sequences", self.role.stage, self.replica_id, len(self._streams))
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        # Sequences moved here and not attached yet count too: a router attaches them, then they move on.
        while (self._streams or self._adopted) and time.monotonic() < deadline:
            for request_id in list(self._streams):
                await self._move(request_id, by_kv=self.engine.kv_transfer_config is not None and bool(replica_ids(self.role.stage)))
            await asyncio.sleep(0.02)  # the ones between no two steps yet: after the next

    async def _move(self, request_id: str, by_kv: bool) -> None:
        """Move one sequence off this replica, by KV if it can (else the router recomputes it)."""
        stream = self._streams.get(request_id)
        held = await self.loop.call(self.engine.freeze, request_id)
        if stream is None or held is None:
            return  # ended meanwhile, or not between two decode steps: try after the next
        moved_to = None
        if by_kv:
            moved_to = await self._move_by_kv(stream.request, held)
        if moved_to is None:
            await self.loop.call(self.engine.abort_request, request_id)
        elif request_id not in self._streams:  # its reader left while it moved: no router will attach to it
            self._abort_moved(request_id, moved_to)
        stream.moved_to = moved_to
        stream.outputs.put_nowait(Moved(moved_to, held))

    def _abort_moved(self, request_id: str, replica_id: str) -> None:
        """Free a sequence moved to ``replica_id`` that nobody will read there (else it decodes
        on, its blocks taken, until its attach times out)."""
        own_serve_request()
        self._pool.abort.remote(request_id, replica_id=replica_id)

    async def _move_by_kv(self, request: EngineRequest, held: list[int]) -> str | None:
        """Ship a frozen sequence's KV to another replica; the replica it went to (None: it did not)."""
        request_id = request.request_id
        resumed = dataclasses.replace(request, output_token_ids=held, kv_receive=True)
        num_blocks = -(-(len(request.prompt_token_ids) + len(held)) // self.engine.block_size)
        own_serve_request()  # the moves' calls overlap (an abort below, the next move)
        try:
            placement = await asyncio.wait_for(self._pool.reserve.remote(resumed, num_prompt_blocks=num_blocks), MOVE_CALL_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - no replica took it: recomputed elsewhere
            logger.warning("no decode replica took %s (%r); it will be recomputed", request_id, error)
            return None
        if await self.loop.call(self.engine.migrate, request_id, placement.destination):
            logger.info("moved %s to replica %s by KV (%d tokens)", request_id, placement.replica_id, len(request.prompt_token_ids) + len(held))
            return placement.replica_id
        self._abort_moved(request_id, placement.replica_id)  # gone here meanwhile: free the blocks there
        return None

    async def _drop_unless_attached(self, request_id: str) -> None:
        await asyncio.sleep(ATTACH_TIMEOUT_S)
        if self._adopted.pop(request_id, None) is not None:
            logger.warning("%s was moved here but no router attached to it in %.0f s; dropping it", request_id, ATTACH_TIMEOUT_S)
            self.loop.unsubscribe(request_id)
            await self.loop.call(self.engine.abort_request, request_id)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def record_routing_stats(self) -> dict:
        """Read off the engine thread: plain counters and lengths, so the report stays on time
        while a long step runs (a replica that stops reporting is taken for dead)."""
        extras = self.role.routing_stats(self.engine) | {"integrity_failures": self.integrity_failures}
        return dataclasses.asdict(ReplicaStats.collect(self.role.stage, self.replica_id, self.engine, **extras))

    def _check_when_idle(self) -> None:
        """At rest every block must be free or held for a transfer. A failure is logged and
        counted, not raised: killing a replica that serves live streams to report a leak would
        lose those streams."""
        try:
            self.engine.check_integrity()
        except BlockIntegrityError as error:
            self.integrity_failures += 1
            logger.error(
                "KV bookkeeping check failed on idle %s replica %s (%d so far): %s",
                self.role.stage, self.replica_id, self.integrity_failures, error,
            )

    async def check_integrity(self, replica_id: str) -> None:
        """Run the bookkeeping check now (on this replica: ``replica_id`` pins the call)."""
        ReplicaGoneError.check(replica_id, self.replica_id)
        await asyncio.wait_for(self.loop.call(self.engine.check_integrity), timeout=30)

    async def check_health(self) -> None:
        """Serve's liveness probe: the engine's workers are up, and its thread runs and answers
        between two steps."""
        if not self.loop.alive():
            raise RuntimeError("the engine thread has stopped")
        await asyncio.to_thread(self.engine.check_health)
        await asyncio.wait_for(self.loop.call(lambda: None), timeout=30)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's load as the pools' autoscaling policies read it (``duet.cluster.autoscale``)."""
        return autoscaling_metrics(ReplicaStats.collect(self.role.stage, self.replica_id, self.engine))

    def __del__(self) -> None:
        """Serve stops the replica once its calls ended (or its patience did): let the KV still
        on its way out (moves, prefills' last layers) reach the other side, then close."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        # With a dead worker nothing drains: no step runs, no transfer ends.
        while (
            self.loop.alive() and self.engine.worker_failure is None
            and self.engine.has_unfinished_requests() and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        for task in self._tasks:
            task.cancel()
        self.loop.stop()
        self.engine.close()


def _request_id(delta: TokenDelta) -> str:
    return delta.request_id
