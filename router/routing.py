"""Serve request routers for the two pools, and the ingress's view of the replicas' stats.

Replicas report a ``ReplicaStats`` dict through Serve's ``record_routing_stats``; the routers
live in the ingress process, so they also serve ``/metrics`` and ``duet status``. A decode
replica has a router of its own pool too: it learns from it that it is leaving the pool.

Every call that names a ``replica_id`` keyword (``abort``, ``attach``, ``check_integrity``) is
pinned to that replica: it concerns state only that replica holds. When
that replica is gone the call goes to any live one, which refuses it at once
(``ReplicaGoneError``): waiting for a replica that will never come back would hold the call,
and Serve's routing loop with it, forever.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import random
import time
import uuid

from ray.serve import context as serve_context
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from duet.messages import ReplicaStats

logger = logging.getLogger(__name__)

# A pool whose every replica has been silent this long is down (the ingress refuses with 503).
# Far above the 3 s after which ``duet status`` calls a report stale: stats come through Serve's
# controller, which a loaded machine holds up for seconds, and Serve replaces a stopped replica
# after its health check's 30 s.
POOL_DOWN_S = 30.0

# Pool name ("prefill", "decode", "colocated") -> the request router of that pool in this process.
_ROUTERS: dict[str, RequestRouter] = {}
# Replica id -> events to set (each on its own event loop) when the replica leaves its pool's set.
_DEPARTURE_WATCHERS: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}


def _module():
    """This module as imported: Serve ships routers and the ingress by value, and each copy's
    functions get their own globals, so only ``sys.modules`` is shared."""
    return importlib.import_module(__name__)


def _registry() -> dict[str, RequestRouter]:
    return _module()._ROUTERS


def watch_departure(replica_id: str) -> asyncio.Event:
    """An event set (on the caller's loop) once a router in this process sees the replica leave
    its pool's set: Serve stopping it (scale-down, redeploy) or its death. A replica watches
    itself through a handle on its own pool, to move its sequences away before it goes."""
    event = asyncio.Event()
    _module()._DEPARTURE_WATCHERS.setdefault(replica_id, []).append((asyncio.get_running_loop(), event))
    return event


def _departed(replica_ids) -> None:
    for replica_id in replica_ids:
        for loop, event in _module()._DEPARTURE_WATCHERS.pop(replica_id, []):
            loop.call_soon_threadsafe(event.set)


def own_serve_request() -> None:
    """Give the current task a Serve request id of its own; call it before each call to a pool
    that may overlap another. Serve's request router matches a routed call to its caller by that
    id, which a task shares with every call made while handling one HTTP request (and with the
    tasks it starts): a second call in flight under the same id is never matched, and waits
    until something cancels it."""
    serve_context._set_request_context(_internal_request_id=uuid.uuid4().hex)


def pool_stats(pool: str) -> list[ReplicaStats] | None:
    """The last stats of each running replica of a pool; None before the pool was first called."""
    router = _registry().get(pool)
    if router is None:
        return None
    stats = []
    for replica in router.curr_replicas.values():
        if replica.routing_stats:
            stats.append(ReplicaStats(**replica.routing_stats))
    return stats


def pool_size(pool: str) -> int | None:
    """Running replicas of a pool as this process's router sees them; None if not known yet."""
    router = _registry().get(pool)
    return None if router is None else len(router.curr_replicas)


def live_replicas(pool: str) -> int | None:
    """Running replicas of a pool that are not down: reported stats in the last ``POOL_DOWN_S``
    seconds (their clocks and ours agree to well within that), or have not reported yet (just
    started); None while this process's router of the pool lists none (before its first call,
    or between Serve's updates: calls then wait in Serve's queue)."""
    router = _registry().get(pool)
    if router is None or not router.curr_replicas:
        return None
    now = time.time()
    stats = [_stats(replica) for replica in router.curr_replicas.values()]
    return sum(1 for replica in stats if replica is None or now - replica.reported_at < POOL_DOWN_S)


def replica_ids(pool: str) -> list[str]:
    """The running replicas of a pool as this process's router sees them (none before its first call)."""
    router = _registry().get(pool)
    return [] if router is None else [replica.unique_id for replica in router.curr_replicas]


def replica_running(pool: str, replica_id: str) -> bool:
    """Whether this process's router of ``pool`` still lists the replica (True before it has a router)."""
    router = _registry().get(pool)
    return router is None or any(replica.unique_id == replica_id for replica in router.curr_replicas)


def _stats(replica: RunningReplica) -> ReplicaStats | None:
    return ReplicaStats(**replica.routing_stats) if replica.routing_stats else None


class _PoolRouter(RequestRouter):
    """Pins calls that name a replica; ranks the others with ``rank``."""

    def initialize_state(self, pool: str) -> None:
        _registry()[pool] = self

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new set of the pool's running replicas; sequences on one that left move."""
        before = {replica.unique_id for replica in self.curr_replicas}
        super().update_replicas(replicas)
        _departed(before - {replica.unique_id for replica in self.curr_replicas})

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        _departed([replica_id.unique_id])

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:
            # Serve sleeps between rounds only when told to (its locality tiers set this); without
            # it a round that chooses nothing is retried at once, and this coroutine never awaits:
            # the routing loop would spin and starve every other call in the process.
            pending_request.routing_context.should_backoff = True
        pinned = kwargs.get("replica_id")
        if pinned is not None:
            chosen = [replica for replica in candidate_replicas if replica.replica_id.unique_id == pinned]
            return [chosen or candidate_replicas]
        # A replica that lost a worker refuses new sequences until Serve replaces it: pass it by.
        working = [replica for replica in candidate_replicas if (stats := _stats(replica)) is None or stats.worker_failure is None]
        return self.rank(working or candidate_replicas, kwargs)

    def rank(self, candidates: list[RunningReplica], kwargs: dict) -> list[list[RunningReplica]]:
        raise NotImplementedError

    def _load(self, replica: RunningReplica) -> int:
        """Requests in flight on the replica as Serve counts them (fresher than the stats)."""
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        if queue_len is not None:
            return queue_len
        stats = _stats(replica)
        return stats.num_running + stats.num_waiting if stats else 0


class PrefixAffinityRouter(_PoolRouter):
    """Prefill pool: the replica holding the longest run of the prompt's leading blocks, unless
    it is busier than the least loaded replica by more than ``imbalance_threshold`` requests;
    otherwise the least loaded (ties broken at random)."""

    def initialize_state(self, pool: str, imbalance_threshold: int = 4) -> None:
        super().initialize_state(pool)
        self.imbalance_threshold = imbalance_threshold

    def rank(self, candidates: list[RunningReplica], kwargs: dict) -> list[list[RunningReplica]]:
        loads = {replica.replica_id: self._load(replica) for replica in candidates}
        by_load = sorted(candidates, key=lambda replica: (loads[replica.replica_id], random.random()))
        prefix_hashes = kwargs.get("prefix_hashes") or []
        best, best_match = None, 0
        for replica in candidates:
            match = _leading_match(prefix_hashes, _stats(replica))
            if match > best_match:
                best, best_match = replica, match
        least = loads[by_load[0].replica_id]
        if best is not None and loads[best.replica_id] - least <= self.imbalance_threshold:
            return [[best], [replica for replica in by_load if replica is not best]]
        return [[replica] for replica in by_load]


def _leading_match(prefix_hashes: list[int], stats: ReplicaStats | None) -> int:
    if stats is None or not stats.prefix_hashes:
        return 0
    cached = set(stats.prefix_hashes)
    match = 0
    for block_hash in prefix_hashes:
        if block_hash not in cached:
            break
        match += 1
    return match


class KVCapacityRouter(_PoolRouter):
    """Decode pool: replicas with room for the prompt's KV (``num_prompt_blocks`` keyword) first,
    fewest running sequences first, most free blocks breaking ties."""

    def rank(self, candidates: list[RunningReplica], kwargs: dict) -> list[list[RunningReplica]]:
        needed = kwargs.get("num_prompt_blocks", 0)

        def key(replica: RunningReplica):
            stats = _stats(replica)
            free = stats.num_free_blocks if stats else 0
            return (stats is not None and free < needed, self._load(replica), -free, random.random())

        return [[replica] for replica in sorted(candidates, key=key)]
