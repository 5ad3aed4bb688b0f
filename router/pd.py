"""One sequence's way through the pools, as token ids (the router makes the text). The calls
are made here; the sequence's phase and what follows a failure are ``duet.router.sequence``'s.

Disaggregated: the decode replica is chosen first (by free KV) and reserves the context's
blocks, answering with its ``Placement`` (a ``KVDestination``); the prefill replica computes
the prompt, sends its KV there (layer by layer as its forward writes it, unless it shares its
cores) and answers with the first token, which goes to the client at once; the decode replica
starts when the last layer lands. A context the prefill pool's queue would make late, where the
decode pool has no room, waits in the router holding no KV (``duet.router.waiting``). Local: one
decode replica computes everything (the colocated mode, and the ``StageBalancer``'s choice).

A sequence outlives its decode replica. One leaving its pool alive (Serve stopping it) moves
the sequence to another replica by KV and ends the stream with ``Moved``: the router attaches
there and reads on. When the replica or a worker died, or the KV was lost or could not move,
the sequence is recomputed: its prompt and the tokens already out go to another decode replica
(their KV computed by the prefill pool or there) and the stream goes on, no token twice, none
missing (what shapes the next tokens is the engine's function of the tokens so far). After
``max_migrations`` moves it fails with a 503 error event. If the prefill replica fails before
the first token, the prompt is computed on a decode replica; a lost prompt KV is recomputed
(``on_transfer_failure: recompute``) or fails the sequence (``fail``); the KV of a sequence
already moved or started over is recomputed whatever the policy. A transfer's wait is bounded
from when its sender queues it, and ends soon after its sender falls silent
(``duet.kv_transfer.receiver``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from ray.exceptions import RayActorError

from duet.block_pool import routing_block_hashes
from duet.errors import (
    InvalidRequestError,
    KVTransferFailedError,
    PoolUnavailableError,
    ReplicaGoneError,
    RequestFailedError,
    WorkerDiedError,
)
from duet.messages import EngineRequest, KVDestination, Moved, TokenDelta
from duet.router.arrivals import ArrivalMeter
from duet.router.balance import Choice, StageBalancer
from duet.router.channels import Channels
from duet.router.decode_stream import DecodeStream, pin
from duet.router.held import HeldContexts, Holder
from duet.router.roles import RoleView
from duet.router.serve_internals import new_call_context, replica_running
from duet.router.sequence import Action, Failure, Phase, Sequence, TooManyMigrations
from duet.router.targets import Targets
from duet.router.waiting import WaitingRoom
from duet.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PINNED_CALL_TIMEOUT_S = 30.0  # a busy replica answers between two steps; only a dead one takes this long
FAILURE_POLICIES = ("recompute", "fail")
# What a prefill replica runs to fill a resumed sequence's KV: the one token it samples is not used.
_FILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class _PlacedAtSource(Exception):
    """The decode pool placed a context on the replica that was to send it its history."""


class Orchestrator:
    """``prefill`` is None in the colocated mode: ``decode`` is then the only pool, and
    ``balancer`` unused. ``roles``: who serves which role when roles move with load
    (``duet.router.roles``; None: each pool serves its own)."""

    def __init__(
        self,
        prefill,
        decode,
        block_size: int,
        balancer: StageBalancer | None,
        on_transfer_failure: str = "recompute",
        max_migrations: int = 3,
        roles: RoleView | None = None,
    ) -> None:
        if on_transfer_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_transfer_failure must be one of {FAILURE_POLICIES}, got {on_transfer_failure!r}")
        self.prefill = prefill
        self.decode = decode
        self.block_size = block_size
        self.balancer = balancer
        self.on_transfer_failure = on_transfer_failure
        self.max_migrations = max_migrations
        self.decode_pool = "decode" if prefill is not None else "colocated"
        self.handles = {self.decode_pool: decode} | ({"prefill": prefill} if prefill is not None else {})
        self.roles = roles
        self.migrations = {"kv": 0, "recompute": 0}
        self.prefill_fallbacks = 0  # contexts computed on decode because their prefill replica failed
        self.history_sends = 0  # contexts a busy decode replica computed past its history and sent (``_history_source``)
        self.history_pulls = 0  # of those, the sends of its cached history alone, the rest computed by the receiver
        self._cleanups: set[asyncio.Task] = set()  # referenced until done, or asyncio may drop them
        self.waiting_room = WaitingRoom(balancer) if balancer is not None else None
        self.open_streams: set[DecodeStream] = set()  # not yet finished or closed
        self.targets = Targets(self.decode_pool, roles, lambda: self.open_streams)  # where calls go past the pools' routers
        self.channels = Channels(self.handles, new_call_context)  # each replica's one stream of every sequence's items
        self.arrivals = ArrivalMeter()  # what this router took in lately, for the planning autoscaler
        self.held = HeldContexts(block_size)  # what its sequences ended with, where (``duet.router.held``)
        self.prefilled = HeldContexts(block_size)  # the contexts it had the prefill pool compute (which replica: not known)
        if balancer is not None:
            balancer.live_streams = lambda: len(self.open_streams)
            balancer.held, balancer.prefilled = self.held, self.prefilled
            balancer.busy_holder = lambda holder: self.targets.holder(holder) is None

    async def run(
        self, sequence_id: str, prompt_token_ids: list[int], params: SamplingParams, lora: tuple[str, str] | None = None
    ) -> AsyncIterator[TokenDelta]:
        """The sequence's deltas (with LoRA adapter ``lora``: its name and folder), wherever it
        runs; started over elsewhere each time it must (``duet.router.sequence`` decides).
        Its arrival and, if it finishes, its length are metered (``self.arrivals``)."""
        ticket = self.arrivals.arrive(len(prompt_token_ids), params.max_tokens)
        output_tokens, finished = 0, False
        try:
            async with aclosing(self._run(sequence_id, prompt_token_ids, params, lora)) as deltas:
                async for delta in deltas:
                    output_tokens += len(delta.token_ids)
                    self.arrivals.progress(ticket, output_tokens)
                    finished = delta.finished and delta.error is None
                    yield delta
        finally:
            self.arrivals.end(ticket, finished)

    async def _run(
        self, sequence_id: str, prompt_token_ids: list[int], params: SamplingParams, lora: tuple[str, str] | None
    ) -> AsyncIterator[TokenDelta]:
        name, path = lora or (None, None)
        request = EngineRequest(sequence_id, prompt_token_ids, params, lora=name, lora_path=path)
        sequence = Sequence(request, self.max_migrations, self.on_transfer_failure)
        moved_to = moved = moved_pool = None
        while True:
            stream = None
            try:
                if sequence.phase is Phase.MOVING:
                    stream = DecodeStream(self, moved, replica_id=moved_to, pool=moved_pool)
                    sequence.to(Phase.DECODING)
                else:
                    async with aclosing(self._start(sequence)) as items:
                        async for item in items:
                            if isinstance(item, DecodeStream):
                                stream = item
                            else:
                                sequence.token_ids += item.token_ids
                                yield item
                    if stream is None:  # the prefill replica's first token ended it
                        sequence.to(Phase.DONE)
                        return
                async for item in stream:
                    if isinstance(item, Moved):
                        moved_to, moved, moved_pool = item.replica_id, stream.request, item.pool or self.decode_pool
                        self.migrations["kv" if moved_to else "recompute"] += 1
                        sequence.moved(by_kv=moved_to is not None)
                        break
                    sequence.token_ids += item.token_ids
                    if item.finished and item.error is None:
                        request = sequence.request
                        self.held.add(stream.replica_id, stream.pool, sequence.context_token_ids(), request.lora, request.lora_path)
                    yield item
                    if item.finished:
                        sequence.to(Phase.DONE)
                        return
                else:
                    raise PoolUnavailableError(f"decode replica {stream.replica_id} ended {sequence.request.request_id} early")
            except TooManyMigrations as error:
                if moved_to is not None and sequence.phase is Phase.FAILED:  # it went on there: stop it
                    request_id, replica_id, handle = moved.request_id, moved_to, self.handles[moved_pool]
                    self.fire(moved_pool, replica_id, lambda: handle.abort.remote(request_id, replica_id=replica_id))
                raise PoolUnavailableError(str(error)) from None
            except (RayActorError, ReplicaGoneError, WorkerDiedError, KVTransferFailedError) as error:
                failure = Failure.KV_LOST if isinstance(error, KVTransferFailedError) else Failure.REPLICA_LOST
                phase = sequence.phase
                try:
                    action = sequence.failed(failure)
                except TooManyMigrations as too_many:
                    raise PoolUnavailableError(str(too_many)) from None
                if action is Action.FAIL:
                    raise
                where = stream.replica_id if stream is not None else "(placing it)"
                if failure is Failure.REPLICA_LOST and stream is not None and stream.replica_id is not None:
                    self.held.forget(stream.replica_id)  # what it held went with it
                logger.warning(
                    "%s lost on decode replica %s while %s (%r); recomputing it", sequence.request.request_id, where, phase.value, error
                )
                self.migrations["recompute"] += 1
                moved_to = None
            finally:
                if stream is not None:
                    await stream.aclose()

    async def _start(self, sequence: Sequence) -> AsyncIterator[TokenDelta | DecodeStream]:
        """Place the sequence (new, or resumed with its tokens so far) on a decode replica, its
        context computed by the prefill pool or there; yields the prefill's first token of a
        new sequence, then the decode stream (none if that token ended it), the caller's to close."""
        request = sequence.request
        hashes = routing_block_hashes(sequence.context_token_ids(), self.block_size, request.lora, request.lora_path)
        if self.prefill is None:  # computed where this router saw its history end, if it did (else where the reports say)
            choice = Choice(True, 0, holder=self.held.holder(hashes))
        else:  # the part a replica holds counts less
            choice = await self.waiting_room.choose(sequence.num_context_tokens, hashes)
        holder = choice.holder
        source = self._history_source(choice)
        if choice.local and source is None:
            stream = await self._place_local(sequence, choice)
            sequence.to(Phase.DECODING)
            yield stream
            return
        num_blocks = -(-sequence.num_context_tokens // self.block_size)
        pulled = None  # a pull, but of a resumed sequence or one with prompt logprobs (the holder computes those)
        if source is not None and not sequence.token_ids and request.params.prompt_logprobs is None:
            pulled = holder.pull_length(sequence.num_context_tokens, self.block_size)
        request = sequence.resumed(kv_receive=True, kv_receive_tokens=pulled)
        settled_by = choice if pulled is not None else None  # a pull's first token is the decode stream's
        stream = DecodeStream(self, request, num_prompt_blocks=num_blocks, choice=settled_by, avoid=source and source[1])
        try:
            placement = await stream.place()
            if source is not None and placement.replica_id == source[1]:  # placed where its history is after all
                raise _PlacedAtSource
            sequence.to(Phase.PREFILLING)
            first = await self._prefill(sequence, stream.request.request_id, placement.destination, source, pulled)
            if settled_by is None:
                choice.done(first_token=True)
        except (InvalidRequestError, RequestFailedError):
            await stream.aclose()
            sequence.failed(Failure.REFUSED)
            raise
        except _PlacedAtSource:
            await stream.aclose()
            stream = await self._place_local(sequence)
            sequence.to(Phase.DECODING)
            yield stream
            return
        except Exception as error:  # noqa: BLE001 - the prefill replica is gone: compute the context on decode
            await stream.aclose()
            if sequence.phase is not Phase.PREFILLING:  # no decode replica took it: nothing to fall back on
                raise
            if sequence.failed(Failure.PREFILL_FAILED) is not Action.COMPUTE_ON_DECODE:
                raise
            logger.warning("prefill of %s failed (%r); computing it on a decode replica", sequence.request.request_id, error)
            self.prefill_fallbacks += 1
            local = await self._place_local(sequence)
            sequence.to(Phase.DECODING)
            yield local
            return
        except BaseException:
            await stream.aclose()
            raise
        finally:
            if settled_by is None:
                choice.done()
        if first is not None:
            try:
                yield first
            except BaseException:
                await stream.aclose()
                raise
            if first.finish_reason is not None:  # the first token ended the sequence
                await stream.aclose()
                return
        sequence.to(Phase.DECODING)
        yield stream

    async def _place_local(self, sequence: Sequence, choice: Choice | None = None) -> DecodeStream:
        stream = DecodeStream(self, sequence.resumed(), choice=choice)
        try:
            await stream.place()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    def _history_source(self, choice: Choice) -> tuple[str, str] | None:
        """Settles the replica a local choice names as holding the context's history
        (``choice.holder``): kept, the context is reserved there first (``DecodeStream``); too
        busy to decode it too (``Targets.holder``), it is dropped from the choice (the pool's
        router places the context) and, in PD, answered as ``(pool, replica_id)``: it computes
        the turn's new tokens and sends the context's KV to the replica that decodes it, rather
        than that replica computing the history again."""
        holder = choice.holder
        if not choice.local or holder is None or holder.replica_id is None or self.targets.holder(holder) is not None:
            return None
        choice.holder = None
        return (holder.pool, holder.replica_id) if self.prefill is not None else None

    async def _prefill(
        self, sequence: Sequence, request_id: str, destination: KVDestination, source: tuple[str, str] | None = None,
        pulled: int | None = None,
    ) -> TokenDelta | None:
        """Have the prefill replica that prefix affinity picks (``source``: the decode replica
        holding its history) compute the context's KV into
        ``destination`` (``request_id``: the placement's): a new sequence's prompt (its first
        token returned), or a resumed one's prompt and outputs but the last (the decode replica
        computes that one; None returned), or (``pulled``) the prompt's first tokens alone (None)."""
        request = sequence.request
        if pulled is not None:  # its RoPE the whole prompt's, where that depends on the length (Phi-3's longrope)
            request = dataclasses.replace(
                request, prompt_token_ids=request.prompt_token_ids[:pulled], params=_FILL_PARAMS, own_prompt_len=len(request.prompt_token_ids)
            )
        elif sequence.token_ids:
            context = request.prompt_token_ids + sequence.token_ids[:-1]
            request = EngineRequest(
                request_id, context, _FILL_PARAMS, lora=request.lora, lora_path=request.lora_path,
                own_prompt_len=len(request.prompt_token_ids),
            )
        request = dataclasses.replace(request, request_id=request_id, kv_send=destination)
        hashes = routing_block_hashes(request.prompt_token_ids, self.block_size, request.lora, request.lora_path)
        pool, pinned = source or self.targets.prefill()
        new_call_context()
        stream = self.handles[pool].options(stream=True).generate.remote(
            request, prefix_hashes=hashes, num_tokens=len(request.prompt_token_ids), lora=request.lora, **pin(pinned),
            **({"from_history": True} if source else {}),
        )
        try:
            async for delta in stream:
                if source is None:
                    self.prefilled.add(None, pool, request.prompt_token_ids, request.lora, request.lora_path)
                else:
                    self.history_sends += 1
                    self.history_pulls += pulled is not None
                return None if sequence.token_ids or pulled is not None else delta
        finally:
            stream.cancel()
        raise PoolUnavailableError("the prefill replica ended the request without a token")

    async def _pinned(self, call):
        response = call()
        try:
            return await asyncio.wait_for(response, PINNED_CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            response.cancel()
            raise

    def fire(self, pool: str, replica_id: str, call) -> None:
        """Send a clean-up call pinned to a replica of ``pool`` without waiting for it; nothing to
        clean where the replica is gone, and a replica that dies mid-call is not waited for."""
        if not replica_running(pool, replica_id):
            return

        async def settle():
            new_call_context()  # beside the sequence's next call, which has the id it inherited
            try:
                await self._pinned(call)
            except (asyncio.TimeoutError, ReplicaGoneError, RayActorError):
                pass  # the replica went away, and what it held with it
            except Exception as error:  # noqa: BLE001 - nothing left to tell the client
                logger.warning("clean-up call on decode replica %s failed: %r", replica_id, error)

        task = asyncio.get_running_loop().create_task(settle())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
