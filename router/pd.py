"""One sequence's way through the pools, as token ids (the router makes the text).

Disaggregated: the decode replica is chosen first (by free KV) and reserves the prompt's
blocks, answering with a ``KVDestination``; the prefill replica computes the prompt, streams
its KV there layer run by layer run as its forward writes them, and answers with the first
token, which goes to the client at once (the same token travels with the KV); the decode
replica starts when the last layer lands and streams the rest. Short prompts (under
``local_prefill_threshold``) and the colocated mode go to the decode pool alone.

If the prefill replica fails before the first token, the prompt is computed on a decode
replica instead; if the KV never arrives, ``on_transfer_failure`` says whether the sequence is
recomputed there from its prompt and first token (``recompute``) or fails (``fail``, 503).
Every way out aborts what the sequence holds in both pools.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from duet.block_pool import ROUTING_PREFIX_BLOCKS, leading_block_hashes
from duet.errors import InvalidRequestError, KVTransferFailedError, ReplicaFullError, ReplicaGoneError, RequestFailedError
from duet.messages import EngineRequest, KVDestination, TokenDelta
from duet.router.routing import replica_running
from duet.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PINNED_CALL_TIMEOUT_S = 30.0  # a busy replica answers between two steps; only a dead one takes this long
DECODE_ATTEMPTS = 3
FAILURE_POLICIES = ("recompute", "fail")


class PoolUnavailableError(RuntimeError):
    """No replica of a pool could take the request; the client should retry later (HTTP 503)."""


class Orchestrator:
    """``prefill`` is None in the colocated mode: ``decode`` is then the only pool."""

    def __init__(self, prefill, decode, block_size: int, local_prefill_threshold: int, on_transfer_failure: str = "recompute") -> None:
        if on_transfer_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {FAILURE_POLICIES}, got {on_transfer_failure!r}")
        self.prefill = prefill
        self.decode = decode
        self.block_size = block_size
        self.local_prefill_threshold = local_prefill_threshold
        self.on_transfer_failure = on_transfer_failure
        self._cleanups: set[asyncio.Task] = set()  # referenced until done, or asyncio may drop them

    def wants_prefill_pool(self, num_prompt_tokens: int) -> bool:
        return self.prefill is not None and num_prompt_tokens >= self.local_prefill_threshold

    async def run(self, sequence_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        local = EngineRequest(sequence_id, prompt_token_ids, params)
        if not self.wants_prefill_pool(len(prompt_token_ids)):
            async with aclosing(self._decode(local)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        # Closed on every way out, so the decode side is cancelled and aborted at once.
        async with aclosing(self._reserve_and_decode(dataclasses.replace(local, kv_receive=True))) as decoding:
            destination = await anext(decoding)
            try:
                first = await self._prefill(dataclasses.replace(local, kv_send=destination))
            except (InvalidRequestError, RequestFailedError):
                raise
            except Exception as error:  # noqa: BLE001 - the prefill replica is gone: compute the prompt on decode
                logger.warning("prefill of %s failed (%r); computing its prompt on a decode replica", sequence_id, error)
                await decoding.aclose()
                async with aclosing(self._decode(local)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            yield first
            if first.finish_reason is not None:  # the first token ended the sequence
                return
            try:
                async for delta in decoding:
                    yield delta
                return
            except KVTransferFailedError:
                if self.on_transfer_failure == "fail":
                    raise
        logger.warning("the KV of %s was lost; recomputing its prompt and first token on a decode replica", sequence_id)
        async with aclosing(self._decode(dataclasses.replace(local, output_token_ids=first.token_ids))) as deltas:
            async for delta in deltas:
                yield delta

    async def _prefill(self, request: EngineRequest) -> TokenDelta:
        """The first token, from the prefill replica that prefix affinity picks."""
        hashes = leading_block_hashes(request.prompt_token_ids, self.block_size, ROUTING_PREFIX_BLOCKS)
        stream = self.prefill.options(stream=True).generate.remote(request, prefix_hashes=hashes)
        try:
            async for delta in stream:
                return delta
        finally:
            stream.cancel()
        raise PoolUnavailableError("the prefill replica ended the request without a token")

    async def _reserve_and_decode(self, request: EngineRequest) -> AsyncIterator[KVDestination | TokenDelta]:
        """First the destination (a decode replica with room reserved the blocks), then the
        sequence's deltas from that replica."""
        num_blocks = -(-len(request.prompt_token_ids) // self.block_size)
        async with aclosing(self._decode(request, num_prompt_blocks=num_blocks)) as deltas:
            async for item in deltas:
                yield item

    async def _decode(self, request: EngineRequest, num_prompt_blocks: int = 0) -> AsyncIterator[KVDestination | TokenDelta]:
        """Stream the sequence from a decode replica; a full one sends us to another."""
        for attempt in range(DECODE_ATTEMPTS):
            stream = self.decode.options(stream=True).generate.remote(request, num_prompt_blocks=num_prompt_blocks)
            replica_id = None
            finished = False
            try:
                async for item in stream:
                    if isinstance(item, KVDestination):
                        replica_id = item.replica_id
                    else:
                        finished = item.finished
                    yield item
                return
            except ReplicaFullError as error:
                if attempt == DECODE_ATTEMPTS - 1:
                    raise PoolUnavailableError(f"no decode replica has room for this request: {error}") from None
                await asyncio.sleep(0.05 * (attempt + 1))
            finally:
                if not finished:
                    stream.cancel()
                    if replica_id is not None:
                        self._fire("decode", replica_id, lambda: self.decode.abort.remote(request.request_id, replica_id=replica_id))

    def _fire(self, pool: str, replica_id: str, call) -> None:
        """Send a clean-up call pinned to a replica without waiting for it; nothing to clean
        where the replica is gone, and a replica that dies mid-call is not waited for."""
        if not replica_running(pool, replica_id):
            return

        async def settle():
            response = call()
            try:
                await asyncio.wait_for(response, PINNED_CALL_TIMEOUT_S)
            except asyncio.TimeoutError:
                response.cancel()
            except ReplicaGoneError:
                pass  # the replica went away, and what it held with it
            except Exception as error:  # noqa: BLE001 - nothing left to tell the client
                logger.warning("clean-up call on %s replica %s failed: %r", pool, replica_id, error)

        task = asyncio.get_running_loop().create_task(settle())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
