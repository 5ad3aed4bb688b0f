"""The decode pool's Serve deployment: a ``DecodeNode`` stepped by an ``EngineLoop``.

``generate`` streams one sequence. Given a ``KVHandle`` it first yields a ``KVTarget`` (the
router then tells the prefill replica to send the KV there), then the tokens after the first;
without one it prefills the prompt itself (short prompts, and the colocated mode).
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
from duet.decode_node.node import DecodeNode, NoKVCapacityError, TransferFailure
from duet.engine import RequestValidationError
from duet.engine_loop import EngineLoop
from duet.kv_transfer import KVHandle
from duet.kv_transfer.group import resolve_host
from duet.messages import (
    DeltaCursor,
    InvalidRequestError,
    KVTarget,
    KVTransferFailedError,
    ReplicaFullError,
    ReplicaGoneError,
    ReplicaStats,
    RequestFailedError,
    StreamDelta,
)
from duet.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)


class DecodeServer:
    """Serve deployment class for the decode pool, or for the one pool of the colocated mode."""

    def __init__(
        self,
        engine_args: dict,
        num_threads: int,
        local_prefill_threshold: int = 0,
        on_transfer_failure: str = "recompute",
        transfer_timeout_s: float = 30.0,
        stage: str = "decode",
        kv_host: str = "127.0.0.1",
    ) -> None:
        keep_replica_on_loopback()
        torch.set_num_threads(num_threads)
        self.stage = stage
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node = DecodeNode(
            EngineArgs(**engine_args), self.replica_id, host=resolve_host(kv_host), local_prefill_threshold=local_prefill_threshold,
            on_transfer_failure=on_transfer_failure, transfer_timeout_s=transfer_timeout_s,
        )
        self.integrity_failures = 0
        self.loop = EngineLoop(
            self._step, _output_key, lambda: self.node.has_work, name=f"{stage}-loop", on_idle=self._check_when_idle
        )
        logger.info("%s replica %s ready with %d threads", stage, self.replica_id, num_threads)

    def _step(self) -> list:
        outputs = self.node.step()
        if self.node.failures:
            outputs += self.node.failures
            self.node.failures = []
        return outputs

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_handle: dict | None = None,
        num_sent_chars: int = 0,
        num_prompt_blocks: int = 0,
    ) -> AsyncIterator[KVTarget | StreamDelta]:
        """Stream one sequence. ``num_prompt_blocks`` is the router's routing hint; unused here."""
        outputs = self.loop.subscribe(request_id)
        finished = False
        try:
            if kv_handle is None:
                await self._call(self.node.submit_local, request_id, prompt_token_ids, params)
                cursor = DeltaCursor()
            else:
                handle = KVHandle(**{**kv_handle, "prompt_token_ids": tuple(kv_handle["prompt_token_ids"])})
                pair_key = await self._call(self.node.accept, handle, params)
                endpoint = dataclasses.asdict(self.node.endpoint)
                yield KVTarget(self.replica_id, handle.transfer_id, endpoint, pair_key)
                cursor = DeltaCursor(num_sent_tokens=1, num_sent_chars=num_sent_chars)
            while not finished:
                item = await outputs.get()
                if isinstance(item, TransferFailure):
                    finished = True
                    raise KVTransferFailedError(f"the prompt's KV did not arrive: {item.error}")
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(item.error)
                delta = cursor.advance(item.outputs[0], item.num_cached_tokens)
                if delta.token_ids or delta.text or finished:
                    yield delta
        finally:
            self.loop.unsubscribe(request_id)
            if not finished:
                self.loop.call_soon(self.node.abort, request_id)

    async def _call(self, fn, *args):
        """Run an engine call, turning its refusals into the errors the router understands."""
        try:
            return await self.loop.call(fn, *args)
        except (RequestValidationError, SamplingParamsError) as error:
            raise InvalidRequestError(str(error)) from None
        except NoKVCapacityError as error:
            raise ReplicaFullError(str(error)) from None

    async def abort(self, request_id: str, replica_id: str) -> None:
        ReplicaGoneError.check(replica_id, self.replica_id)
        await self.loop.call(self.node.abort, request_id)

    async def record_routing_stats(self) -> dict:
        """Read off the engine thread: plain counters and lengths, so the report stays on time
        while a long step runs (a replica that stops reporting is taken for dead)."""
        return dataclasses.asdict(self._stats())

    def _stats(self) -> ReplicaStats:
        return ReplicaStats.collect(
            self.stage, self.replica_id, self.node.engine, self.node.receiver.stats, pending_transfers=self.node.pending_transfers,
            integrity_failures=self.integrity_failures,
        )

    def _check_when_idle(self) -> None:
        """At rest every block must be free or held for KV on its way. A failure is logged and
        counted, not raised: killing a replica that serves live streams to report a leak would
        lose those streams."""
        try:
            self.node.check_integrity()
        except BlockIntegrityError as error:
            self.integrity_failures += 1
            logger.error("KV bookkeeping check failed on idle %s replica %s (%d so far): %s", self.stage, self.replica_id, self.integrity_failures, error)

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


def _output_key(output) -> str:
    return output.request_id
