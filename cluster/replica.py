"""The one Serve deployment class of every pool: an engine stepped by an ``EngineLoop``,
configured by its role (``prefill_node.role``, ``decode_node.role``).

Every sequence is placed on a decode (or colocated) replica the same way, new, moved or
recomputed: ``reserve`` adds it and answers its ``Placement`` (its replica, and for a
``kv_receive`` request the ``KVDestination`` of the blocks it reserved), then ``attach_to``
sends its ``TokenDelta``s through the router's ``channel`` from this replica, one message a
step for all its sequences (``duet.decode_node.channel``). A prefill replica's call is
``generate``, whose stream is the prompt's first token. Calls that name a ``replica_id``
(``abort``, ``channel``, ``attach_to``, ``check_integrity``) are pinned to that replica (see
``duet.router.routing``).

A replica of a PD application serves its pool's role or, while the router's ``RoleKeeper``
has it so, the other one (``take_role``; ``duet.router.roles``): ``generate`` and ``reserve``
are each served by the role that takes them, and a sequence placed here streams on whatever
role the replica takes next.

A decode replica that leaves its pool while alive moves its sequences to the others
(``duet.decode_node.migration``): it watches its own pool through a handle of its own, which
is also how it reaches the others (``duet.cluster.peers``). A leaving prefill replica finishes what
it has (Serve routes nothing new to it; streams it serves in the decode role end within
Serve's graceful shutdown, or are recomputed) and its transfers before its engine closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import ray
import torch
from ray import serve

from duet.block_pool import BlockIntegrityError
from duet.cluster.autoscale import autoscaling_metrics
from duet.cluster.peers import ServePeers
from duet.config import EngineArgs
from duet.cores import CoreShare, machine_cores
from duet.decode_node.channel import Channels
from duet.decode_node.migration import DRAIN_TIMEOUT_S, Migration, Peers, Stream, Target
from duet.decode_node.role import DecodeRole
from duet.engine import LLMEngine
from duet.engine_loop import EngineLoop, EngineThread
from duet.errors import InvalidRequestError, KVTransferFailedError, ReplicaFullError, ReplicaGoneError, RequestFailedError
from duet.messages import EngineRequest, KVDestination, Moved, Placement, ReplicaStats, TokenDelta
from duet.prefill_node.role import PrefillRole
from duet.router.serve_internals import keep_replica_on_loopback, watch_departure
from duet.structured_output import build_before_serving

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")
# Serve waits this long for a stopped replica's calls to end before killing it (its default, 20
# s, cuts long streams; here they move away, so it is rarely reached).
GRACEFUL_SHUTDOWN_TIMEOUT_S = 60.0
# Serve probes each replica this often (its default is 10 s): one whose worker died is found,
# and replaced, within seconds.
HEALTH_CHECK_PERIOD_S = 2.0


class EngineReplica:
    """One engine serving a role, hosted without Serve: ``ServeReplica`` is the deployment,
    which builds these parts. ``role``: its pool's (its home); ``peers``: the decode pool's
    replicas, which this one moves its sequences to when it leaves (None: a prefill replica
    that never serves decode). ``thread``: the ``EngineThread`` the engine was built on, which
    then steps it (None: a new thread)."""

    def __init__(
        self,
        replica_id: str,
        role: PrefillRole | DecodeRole,
        engine: LLMEngine,
        peers: Peers | None = None,
        node_id: str = "",
        thread: EngineThread | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.node_id = node_id
        self.role = role
        self.home = role.stage
        self._roles = {role.stage: role}
        self._role_since = time.monotonic()
        self.engine = engine
        build_before_serving(engine.grammar_tokenizer)  # its build stalls the whole process (duet.structured_output)
        self.integrity_failures = 0
        self._report: ReplicaStats | None = None  # the last sent
        self.loop = EngineLoop(
            engine.step, _request_id, engine.has_unfinished_requests, name=f"{role.stage}-loop", on_idle=self._check_when_idle, thread=thread,
        )
        engine.executor.on_kv_results(self.loop.wake)
        self.draining = False
        self._streams: dict[str, Stream] = {}
        self.channels = Channels()
        self._tasks: set[asyncio.Task] = set()
        self.migration = None
        if peers is not None:
            by_kv = engine.kv_transfer_config is not None
            self.migration = Migration(replica_id, engine, self.loop, self._streams, peers, by_kv)

    async def generate(
        self, request: EngineRequest, prefix_hashes: list[int] | None = None, replica_id: str | None = None, lora: str | None = None,
        from_history: bool = False, num_tokens: int = 0,
    ) -> AsyncIterator[TokenDelta]:
        """The prefill role's call: compute the prompt, stream its KV to ``request.kv_send``, and
        answer with the first token. ``prefix_hashes``, ``num_tokens`` (the prompt's) and ``lora``
        (its adapter) are hints for the pool's request router;
        ``replica_id`` pins the call to this replica. The decode role places sequences by
        ``reserve`` and ``attach_to``. ``from_history``: a context whose history this replica's
        prefix cache holds (a turn after one it decoded), sent here by a router that found it too
        busy to decode the turn: served in either role by a replica of a PD application, which
        computes the tokens past its history (for a pull, the history cut one token past its
        cached blocks: that one token) and sends their KV, rather than another replica computing
        the history again (refused as full by any other)."""
        if replica_id is not None:
            ReplicaGoneError.check(replica_id, self.replica_id)
        if from_history and self.role.stage != "prefill":
            if self.migration is None or not self.migration.by_kv or request.kv_send is None:
                raise ReplicaFullError(f"replica {self.replica_id} sends no KV: the context goes elsewhere")
            self._refuse_new_sequences()
        else:
            self._check_role("prefill")
            self._refuse_new_sequences()
            self.role.admit(request, self.engine.block_size)
        stream, _ = await self._add(request)
        async with aclosing(self._follow(stream)) as items:
            async for item in items:
                yield item

    async def reserve(
        self, request: EngineRequest, num_prompt_blocks: int = 0, replica_id: str | None = None, lora: str | None = None,
        prefix_hashes: list[int] | None = None, avoid: str | None = None,
    ) -> Placement:
        """The decode role's call: place a sequence here, add it to the engine (its blocks
        reserved, for KV from elsewhere when ``kv_receive``) and answer where it runs and where
        its KV goes. Its outputs wait for ``attach_to``; nobody attaching within
        ``ATTACH_TIMEOUT_S`` drops it. ``num_prompt_blocks``, ``prefix_hashes`` (a context
        computed here), ``lora`` (its adapter) and ``avoid`` (the replica that sends its KV) are
        hints for the pool's request router;
        ``replica_id`` pins the call to this replica."""
        if replica_id is not None:
            ReplicaGoneError.check(replica_id, self.replica_id)
        self._check_role("decode")
        self._refuse_new_sequences()
        self.role.admit(request, self.engine.block_size)
        stream, destination = await self._add(request)
        self.migration.adopt(stream)
        self._spawn(self.migration.drop_unless_attached(request.request_id))
        return Placement(self.replica_id, destination)

    async def _add(self, request: EngineRequest) -> tuple[Stream, KVDestination | None]:
        """Subscribe to the sequence's outputs and add it to the engine: its stream, and where
        its KV is to be sent when it comes from elsewhere."""
        if request.params.structured_outputs is not None:  # its slow first checks, off the engine thread
            await asyncio.to_thread(self.engine.check_constraint, request.params)
        if request.lora is not None and not self.engine.loras.checked(request.lora, request.lora_path):
            # an adapter not seen before is read to be checked: off the engine thread too
            await asyncio.to_thread(self.engine.check_lora, request.lora, request.lora_path)
        stream = Stream(request, self.loop.subscribe(request.request_id))
        try:
            return stream, await self.loop.call(self.engine.add_request, request)
        except Exception:  # refused: it never joined the engine
            self.loop.unsubscribe(request.request_id)
            raise
        except BaseException:  # cancelled: the engine adds it all the same, then this aborts it
            self.loop.unsubscribe(request.request_id)
            self.loop.call_soon(self.engine.abort_request, request.request_id)
            raise

    async def check_lora(self, name: str, path: str) -> None:
        """Check a LoRA adapter against this replica's model before the router serves it
        (``InvalidRequestError``: why it does not fit)."""
        await asyncio.to_thread(self.engine.check_lora, name, path)

    async def channel(self, channel_id: str, replica_id: str) -> AsyncIterator[list]:
        """A router's one stream from this replica: its sequences' items, a batch a step
        (``duet.decode_node.channel``)."""
        ReplicaGoneError.check(replica_id, self.replica_id)
        async with aclosing(self.channels.serve(channel_id)) as batches:
            async for batch in batches:
                yield batch

    async def attach_to(self, request_id: str, replica_id: str, channel_id: str) -> None:
        """Stream a sequence placed here by ``reserve``, from its first token made here, through
        the router's ``channel_id``: returns when the sequence has ended (cancelled: its reader
        left, and it is aborted)."""
        await self.channels.feed(channel_id, request_id, self._follow(self._attached(request_id, replica_id)))

    def _attached(self, request_id: str, replica_id: str) -> Stream:
        ReplicaGoneError.check(replica_id, self.replica_id)
        if self.migration is None:
            raise ReplicaGoneError(f"{request_id} is not held on replica {self.replica_id}: a prefill replica places no sequence")
        return self.migration.attach(request_id)

    async def _follow(self, stream: Stream) -> AsyncIterator[TokenDelta | Moved]:
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
                    self.migration.peers.abort(request_id, stream.moved_to, stream.moved_pool)

    async def abort(self, request_id: str, replica_id: str) -> None:
        ReplicaGoneError.check(replica_id, self.replica_id)
        if self.migration is not None:
            self.migration.forget(request_id)
        await self.loop.call(self.engine.abort_request, request_id)

    def _check_role(self, stage: str) -> None:
        """A call of the role ``stage`` (prefill: ``generate``; decode: ``reserve``). Refused as
        a mistake where this replica can never serve it, as a passing ``ReplicaFullError`` (the
        router tries elsewhere) while it serves the other role."""
        serving = self.role.stage
        if stage == "decode" and self.migration is None:
            raise InvalidRequestError(f"replica {self.replica_id} is a prefill replica: it places no sequence")
        if serving == stage or (stage == "decode" and serving == "colocated"):
            return
        if self.migration is None or self.home == "colocated":
            raise InvalidRequestError(f"replica {self.replica_id} is a {serving} replica: it serves no {stage} call")
        raise ReplicaFullError(f"replica {self.replica_id} serves the {serving} role now")

    async def take_role(self, stage: str, replica_id: str, hold_s: float = 0.0) -> str:
        """Serve ``stage`` (prefill or decode) from now on, keeping what this replica holds: its
        sequences stream on, its prefix cache stays. A replica that changed role less than
        ``hold_s`` ago keeps the one it has. Answers the role it serves."""
        ReplicaGoneError.check(replica_id, self.replica_id)
        if stage not in ("prefill", "decode"):
            raise InvalidRequestError(f"no role {stage!r}: prefill or decode")
        if self.home == "colocated" or self.migration is None:
            raise InvalidRequestError(f"replica {self.replica_id} serves only the {self.home} role")
        if stage == self.role.stage or self.draining or time.monotonic() - self._role_since < hold_s:
            return self.role.stage
        if stage not in self._roles:
            self._roles[stage] = PrefillRole() if stage == "prefill" else DecodeRole()
        self.role = self._roles[stage]
        self._role_since = time.monotonic()
        if self.engine.core_share is not None:
            self.engine.core_share.state.decode = stage == "decode"
        logger.info("replica %s (%s pool) serves the %s role", self.replica_id, self.home, stage)
        return stage

    async def shed(self, pool: str, to_replica: str, count: int, replica_id: str) -> int:
        """Move up to ``count`` of the sequences this replica decodes, by KV, to ``to_replica`` of
        ``pool`` (a replica that took the decode role while this one has more than its share);
        how many went. Each one's stream ends with ``Moved`` and its router reads on there."""
        ReplicaGoneError.check(replica_id, self.replica_id)
        if self.migration is None or not self.migration.by_kv or self.draining or count <= 0:
            return 0
        return await self.migration.shed(Target(pool, to_replica), count)

    def _refuse_new_sequences(self) -> None:
        if self.draining:
            raise ReplicaFullError(f"replica {self.replica_id} is leaving its pool")
        if self.engine.worker_failure is not None:  # its health check fails: Serve replaces it
            raise ReplicaFullError(f"replica {self.replica_id} lost a worker ({self.engine.worker_failure})")

    async def _leave_when_departed(self, departed: asyncio.Event) -> None:
        """Once this replica has left its pool's set (scaled down, replaced), move its decoding
        sequences away by KV, whatever its home: a prefill replica serving decode moves its
        streams as a decode replica does (its prompts in flight finish here, refused none)."""
        await departed.wait()
        self.draining = True
        await self.migration.leave(self.home)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def record_routing_stats(self) -> dict:
        """Read off the engine thread: plain counters and lengths, so the report stays on time
        while a long step runs (a replica that stops reporting is taken for dead). One that repeats
        the last sends that again (``ReplicaStats.repeats``)."""
        prefix_hashes = self.role.prefix_hashes(self.engine)
        stats = ReplicaStats.compose(
            self.role.stage, self.replica_id, self.node_id, self.engine.stats(), self.integrity_failures, prefix_hashes
        )
        if not stats.repeats(self._report):
            self._report = stats
        return self._report.to_dict()

    def _check_when_idle(self) -> None:
        """At rest every block must be free or held for a transfer. A failure is logged and
        counted, not raised: killing a replica that serves live streams to report a leak would
        lose those streams. At rest the engine also gives up its claim on the cores."""
        if self.engine.core_share is not None:
            self.engine.core_share.idle()
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
        return autoscaling_metrics(self.engine.stats(), away=self.role.stage != self.home)

    def __del__(self) -> None:
        """Serve stops the replica once its calls ended (or its patience did): let the KV still
        on its way out (moves, prefills' last layers) reach the other side, then close (nothing,
        when its constructor failed)."""
        if not hasattr(self, "loop"):
            return
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


def build_engine(args: dict, num_threads: int, name: str) -> tuple[LLMEngine, EngineThread]:
    """An engine with ``num_threads`` torch threads, built on the ``EngineThread`` that is to
    step it: a second thread's OpenMP pool would stop every thread's spinning at barriers
    (``duet.engine_loop``)."""
    thread = EngineThread(name)
    thread.run(torch.set_num_threads, num_threads)
    return thread.run(LLMEngine, EngineArgs(**args)), thread


class ServeReplica(EngineReplica):
    """The Serve deployment of every pool. ``role``: prefill, decode or colocated.
    ``kv_transfer``: the KV connector's settings (``KVTransferConfig`` fields but ``name``,
    which is the replica id), None when colocated."""

    def __init__(
        self, role: str, engine_args: dict, num_threads: int, kv_transfer: dict | None = None, core_sharing: dict | None = None,
    ) -> None:
        keep_replica_on_loopback()
        if core_sharing is not None:  # each step on the threads its share of the machine gives (duet.cores)
            num_threads = machine_cores()
        context = serve.get_replica_context()
        replica_id = context.replica_id.unique_id
        role_ = PrefillRole() if role == "prefill" else DecodeRole(colocated=role == "colocated")
        args = role_.engine_args(engine_args)
        if kv_transfer is not None:
            # On shared cores a sender thread running during the forward would slow its every thread.
            args = args | {"kv_transfer_config": kv_transfer | {"name": replica_id, "stream_layers": core_sharing is None}}
        peers = None
        if role_.stage != "prefill" or kv_transfer is not None:
            # Handles on the pools, the decode pool's (a decode replica's own) first: its router
            # in this process sees the replica set change (this replica leaving it) and sends
            # the moves' reservations to the others; a move may name a replica of either pool
            # (``shed``). A prefill replica of a PD application serves decode when the router
            # has it so (``take_role``).
            pools = ("decode", "prefill") if kv_transfer is not None else (context.deployment,)
            handles = {name: serve.get_deployment_handle(name, context.app_name).options(stream=False) for name in pools}
            peers = ServePeers(handles, pools[0])
        engine, thread = build_engine(args, num_threads, f"{role}-loop")
        if core_sharing is not None:
            engine.core_share = CoreShare(decode=role_.stage != "prefill", tpot_budget_s=core_sharing["tpot_budget_s"])
        super().__init__(replica_id, role_, engine, peers, node_id=ray.get_runtime_context().get_node_id(), thread=thread)
        if self.migration is not None:  # a prefill replica of a PD application may be serving decode when it leaves
            self._spawn(self._leave_when_departed(watch_departure(replica_id)))
        sharing = ", sharing the machine's cores step by step" if core_sharing is not None else ""
        logger.info("%s replica %s ready with %d threads%s", role, replica_id, num_threads, sharing)
