"""The prefill pool's Serve deployment: a ``PrefillNode`` stepped by an ``EngineLoop``.

The router calls ``prefill`` (any replica, chosen by prefix-cache affinity), then
``send_kv`` or ``drop`` on the replica that answered (``replica_id`` pins the call; see
``duet.router.routing``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict

import torch
from ray import serve

from duet.block_pool import BlockIntegrityError, leading_block_hashes
from duet.cluster.loopback import keep_replica_on_loopback
from duet.config import EngineArgs
from duet.engine import RequestValidationError
from duet.engine_loop import EngineLoop
from duet.kv_transfer import Endpoint
from duet.kv_transfer.group import resolve_host
from duet.messages import InvalidRequestError, PrefillReply, ReplicaGoneError, ReplicaStats, RequestFailedError, StreamDelta
from duet.prefill_node.node import PrefillNode, PrefillResult
from duet.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

# How many leading blocks of each prompt the replica reports for prefix-affinity routing.
ROUTING_PREFIX_BLOCKS = 4
MAX_REPORTED_PREFIXES = 512


class PrefillServer:
    """Serve deployment class for the prefill pool (wrapped by ``duet.cluster.app``)."""

    def __init__(self, engine_args: dict, num_threads: int, transfer_timeout_s: float = 30.0, kv_host: str = "127.0.0.1") -> None:
        keep_replica_on_loopback()
        torch.set_num_threads(num_threads)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node = PrefillNode(EngineArgs(**engine_args), self.replica_id, transfer_timeout_s, resolve_host(kv_host))
        self.block_size = self.node.engine.block_size
        self._prefixes: OrderedDict[int, None] = OrderedDict()
        self.integrity_failures = 0
        self.loop = EngineLoop(
            self.node.step, _result_key, lambda: self.node.has_work, name="prefill-loop", on_idle=self._check_when_idle
        )
        logger.info("prefill replica %s ready with %d threads", self.replica_id, num_threads)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prefix_hashes=None) -> PrefillReply:
        """Compute the prompt and sample the first token. ``prefix_hashes`` is the router's
        routing hint; it is not used here."""
        outputs = self.loop.subscribe(request_id)
        answered = False
        try:
            try:
                await self.loop.call(self.node.submit, request_id, prompt_token_ids, params)
            except (RequestValidationError, SamplingParamsError) as error:
                raise InvalidRequestError(str(error)) from None
            result = await outputs.get()
            if isinstance(result, Exception):
                raise result
            answered = True
            if result.error is not None:
                raise RequestFailedError(result.error)
            self._remember_prefix(prompt_token_ids)
            return self._reply(result)
        finally:
            self.loop.unsubscribe(request_id)
            if not answered:
                self.loop.call_soon(self.node.abort, request_id)

    def _reply(self, result: PrefillResult) -> PrefillReply:
        first = StreamDelta(
            result.text, [result.first_token_id], result.logprobs, result.finish_reason,
            num_cached_tokens=result.num_cached_tokens,
        )
        handle = dataclasses.asdict(result.handle) if result.handle is not None else None
        return PrefillReply(first, handle, self.replica_id)

    def _remember_prefix(self, prompt_token_ids: list[int]) -> None:
        for block_hash in leading_block_hashes(prompt_token_ids, self.block_size, ROUTING_PREFIX_BLOCKS):
            self._prefixes[block_hash] = None
            self._prefixes.move_to_end(block_hash)
        while len(self._prefixes) > MAX_REPORTED_PREFIXES:
            self._prefixes.popitem(last=False)

    async def send_kv(self, transfer_id: int, endpoint: dict, pair_key: str, replica_id: str) -> None:
        ReplicaGoneError.check(replica_id, self.replica_id)
        await self.loop.call(self.node.send_kv, transfer_id, Endpoint(**endpoint), pair_key)

    async def drop(self, transfer_id: int, replica_id: str) -> None:
        ReplicaGoneError.check(replica_id, self.replica_id)
        await self.loop.call(self.node.drop, transfer_id)

    async def record_routing_stats(self) -> dict:
        """Read off the engine thread: plain counters and lengths, so the report stays on time
        while a long step runs (a replica that stops reporting is taken for dead)."""
        return dataclasses.asdict(self._stats())

    def _stats(self) -> ReplicaStats:
        pool = self.node.engine.kv_cache_manager.block_pool
        prefixes = [block_hash for block_hash in self._prefixes if pool.is_cached(block_hash)]
        return ReplicaStats.collect(
            "prefill", self.replica_id, self.node.engine, self.node.sender.stats, prefix_hashes=prefixes,
            integrity_failures=self.integrity_failures,
        )

    def _check_when_idle(self) -> None:
        """At rest every block must be free or held for a pull or a transfer. A failure is logged
        and counted, not raised: killing a replica that serves live streams to report a leak
        would lose those streams."""
        try:
            self.node.check_integrity()
        except BlockIntegrityError as error:
            self.integrity_failures += 1
            logger.error("KV bookkeeping check failed on idle prefill replica %s (%d so far): %s", self.replica_id, self.integrity_failures, error)

    async def check_integrity(self, replica_id: str) -> None:
        """Run the bookkeeping check now (on this replica: ``replica_id`` pins the call)."""
        ReplicaGoneError.check(replica_id, self.replica_id)
        await asyncio.wait_for(self.loop.call(self.node.check_integrity), timeout=30)

    async def check_health(self) -> None:
        """Serve's liveness probe: the engine thread runs and answers between two steps."""
        if not self.loop.alive():
            raise RuntimeError("the engine thread has stopped")
        await asyncio.wait_for(self.loop.call(lambda: None), timeout=30)

    def __del__(self) -> None:
        self.loop.stop()
        self.node.close()


def _result_key(result: PrefillResult) -> str:
    return result.request_id
