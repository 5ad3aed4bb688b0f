"""One sequence's way through the pools: prefill (first token and a ``KVHandle``), then decode
(KV pulled from the prefill replica, tokens streamed); or decode alone for short prompts and
the colocated mode. Yields ``StreamDelta``s and cleans up after itself however it ends."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from duet.block_pool import leading_block_hashes
from duet.messages import KVTarget, ReplicaFullError, ReplicaGoneError, StreamDelta
from duet.router.routing import replica_running
from duet.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ROUTING_PREFIX_BLOCKS = 4  # as many leading blocks as the prefill replicas report
PINNED_CALL_TIMEOUT_S = 30.0  # a busy replica answers between two steps; only a dead one takes this long
DECODE_ATTEMPTS = 3


class PoolUnavailableError(RuntimeError):
    """No replica of a pool could take the request; the client should retry later (HTTP 503)."""


class Orchestrator:
    """``prefill`` is None in the colocated mode: ``decode`` is then the only pool."""

    def __init__(self, prefill, decode, block_size: int, local_prefill_threshold: int) -> None:
        self.prefill = prefill
        self.decode = decode
        self.block_size = block_size
        self.local_prefill_threshold = local_prefill_threshold
        self._cleanups: set[asyncio.Task] = set()  # referenced until done, or asyncio may drop them

    def wants_prefill_pool(self, num_prompt_tokens: int) -> bool:
        return self.prefill is not None and num_prompt_tokens >= self.local_prefill_threshold

    async def run(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[StreamDelta]:
        if not self.wants_prefill_pool(len(prompt_token_ids)):
            async with aclosing(self._decode(request_id, prompt_token_ids, params, None, 0)) as deltas:
                async for delta in deltas:
                    yield delta
            return
        hashes = leading_block_hashes(prompt_token_ids, self.block_size, ROUTING_PREFIX_BLOCKS)
        reply = await self.prefill.prefill.remote(request_id, prompt_token_ids, params, prefix_hashes=hashes)
        handle = reply.kv_handle
        try:
            yield reply.first
            if handle is None:
                return
            # Closed on every way out, so the decode side is cancelled and aborted at once.
            async with aclosing(self._decode(request_id, prompt_token_ids, params, reply, len(reply.first.text))) as deltas:
                async for delta in deltas:
                    if handle is not None and isinstance(delta, KVTarget):
                        await self._pinned(
                            "prefill", reply.replica_id,
                            lambda: self.prefill.send_kv.remote(delta.transfer_id, delta.endpoint, delta.pair_key, replica_id=reply.replica_id),
                        )
                        handle = None  # the prefill replica unpins it once the transfer ends
                        continue
                    yield delta
        finally:
            if handle is not None:
                self._fire("prefill", reply.replica_id, lambda: self.prefill.drop.remote(handle["transfer_id"], replica_id=reply.replica_id))

    async def _decode(self, request_id, prompt_token_ids, params, reply, num_sent_chars) -> AsyncIterator:
        kv_handle = reply.kv_handle if reply is not None else None
        num_blocks = -(-len(prompt_token_ids) // self.block_size)
        for attempt in range(DECODE_ATTEMPTS):
            stream = self.decode.options(stream=True).generate.remote(
                request_id, prompt_token_ids, params, kv_handle=kv_handle, num_sent_chars=num_sent_chars,
                num_prompt_blocks=num_blocks,
            )
            target = None
            finished = False
            try:
                async for item in stream:
                    if isinstance(item, KVTarget):
                        target = item
                    finished = isinstance(item, StreamDelta) and item.finish_reason is not None
                    yield item
                return
            except ReplicaFullError as error:
                if attempt == DECODE_ATTEMPTS - 1:
                    raise PoolUnavailableError(f"no decode replica has room for this request: {error}") from None
                await asyncio.sleep(0.05 * (attempt + 1))
            finally:
                if not finished:
                    stream.cancel()
                    if target is not None:
                        self._fire("decode", target.replica_id, lambda: self.decode.abort.remote(request_id, replica_id=target.replica_id))

    async def _pinned(self, pool: str, replica_id: str, call):
        """Make a call pinned to one replica (``call()`` sends it); fail at once if the replica is
        gone, and bound the wait: a replica that dies mid-call never answers."""
        if not replica_running(pool, replica_id):
            raise PoolUnavailableError(f"the {pool} replica holding this request's state is gone")
        response = call()
        try:
            return await asyncio.wait_for(response, PINNED_CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            response.cancel()
            raise PoolUnavailableError(f"the {pool} replica holding this request's state did not answer") from None
        except ReplicaGoneError as error:
            raise PoolUnavailableError(f"the {pool} replica holding this request's state is gone") from error

    def _fire(self, pool: str, replica_id: str, call) -> None:
        """Send a clean-up call without waiting for it; nothing to clean where the replica is gone."""
        if not replica_running(pool, replica_id):
            return

        async def settle():
            try:
                await self._pinned(pool, replica_id, call)
            except PoolUnavailableError:
                pass  # the replica went away, and what it held with it
            except Exception as error:  # noqa: BLE001 - nothing left to tell the client
                logger.warning("clean-up call on %s replica %s failed: %r", pool, replica_id, error)

        task = asyncio.get_running_loop().create_task(settle())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
