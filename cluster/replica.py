"""The one Serve deployment class of every pool: an engine stepped by an ``EngineLoop``,
configured by its role (``prefill_node.role``, ``decode_node.role``).

``generate`` streams one sequence: for a ``kv_receive`` request first the ``KVDestination``
(blocks reserved), then ``TokenDelta``s; a prefill replica's stream is its first token. Calls
that name a ``replica_id`` (``abort``, ``check_integrity``) are pinned to that replica (see
``duet.router.routing``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

import torch
from ray import serve

from duet.block_pool import BlockIntegrityError
from duet.cluster.loopback import keep_replica_on_loopback
from duet.config import EngineArgs
from duet.decode_node.role import DecodeRole
from duet.engine import LLMEngine
from duet.engine_loop import EngineLoop
from duet.errors import KVTransferFailedError, ReplicaGoneError, RequestFailedError
from duet.messages import EngineRequest, KVDestination, ReplicaStats, TokenDelta
from duet.prefill_node.role import PrefillRole

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")


class EngineReplica:
    """``role``: prefill, decode or colocated. ``kv_transfer``: the KV connector's settings
    (``KVTransferConfig`` fields but ``name``, which is the replica id), None when colocated."""

    def __init__(self, role: str, engine_args: dict, num_threads: int, kv_transfer: dict | None = None) -> None:
        keep_replica_on_loopback()
        torch.set_num_threads(num_threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.role = PrefillRole() if role == "prefill" else DecodeRole(colocated=role == "colocated")
        args = self.role.engine_args(engine_args)
        if kv_transfer is not None:
            args = args | {"kv_transfer_config": kv_transfer | {"name": self.replica_id}}
        self.engine = LLMEngine(EngineArgs(**args))
        self.integrity_failures = 0
        self.loop = EngineLoop(
            self.engine.step, _request_id, self.engine.has_unfinished_requests, name=f"{role}-loop", on_idle=self._check_when_idle
        )
        logger.info("%s replica %s ready with %d threads", role, self.replica_id, num_threads)

    async def generate(
        self, request: EngineRequest, prefix_hashes: list[int] | None = None, num_prompt_blocks: int = 0
    ) -> AsyncIterator[KVDestination | TokenDelta]:
        """Stream one sequence; it is aborted in the engine however the stream ends early.
        ``prefix_hashes`` and ``num_prompt_blocks`` are hints for the pools' request routers."""
        outputs = self.loop.subscribe(request.request_id)
        finished = False
        try:
            self.role.admit(request, self.engine.block_size)
            destination = await self.loop.call(self.engine.add_request, request)
            if destination is not None:
                yield destination
            while not finished:
                item = await outputs.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise (KVTransferFailedError if item.kv_lost else RequestFailedError)(item.error)
                yield item
        finally:
            self.loop.unsubscribe(request.request_id)
            if not finished:
                self.loop.call_soon(self.engine.abort_request, request.request_id)

    async def abort(self, request_id: str, replica_id: str) -> None:
        ReplicaGoneError.check(replica_id, self.replica_id)
        await self.loop.call(self.engine.abort_request, request_id)

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
        """Serve's liveness probe: the engine thread runs and answers between two steps."""
        if not self.loop.alive():
            raise RuntimeError("the engine thread has stopped")
        await asyncio.wait_for(self.loop.call(lambda: None), timeout=30)

    def __del__(self) -> None:
        self.loop.stop()
        self.engine.close()


def _request_id(delta: TokenDelta) -> str:
    return delta.request_id
