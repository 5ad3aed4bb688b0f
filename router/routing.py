"""Serve request routers for the two pools: which replica takes a call.

Replicas report a ``ReplicaStats`` dict through Serve's ``record_routing_stats``; each router
registers itself (``duet.router.serve_internals``), so the ingress's view of the pools and a
decode replica's notice of its own departure come from the routers in its process.

Every call that names a ``replica_id`` keyword (``abort``, ``channel``, ``attach_to``, ``check_integrity``) is
pinned to that replica: it concerns state only that replica holds. When
that replica is gone the call goes to any live one, which refuses it at once
(``ReplicaGoneError``): waiting for a replica that will never come back would hold the call,
and Serve's routing loop with it, forever.

A call for a LoRA adapter (``lora`` keyword) counts a replica that holds it (its report's
``lora.held``) as ``ADAPTER_LOAD_CREDIT`` requests less busy than it is: held adapters draw
their requests without loading them anew, where that does not crowd one replica.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from duet.block_pool import held_blocks
from duet.messages import ReplicaStats
from duet.router.serve_internals import departed, register_router, reported_stats

ADAPTER_LOAD_CREDIT = 2
# A replica holding a context's prefix takes it while its load passes the least loaded's by this
# many requests at most (the ingress's pin to where a history ended keeps the same rule).
IMBALANCE_THRESHOLD = 4
# Prefill: replicas whose prompt tokens to compute before a prompt's first token come within this
# factor of the fewest count as equal, the least loaded of them taking it (``rank_by_prefix``).
NEAR_COST = 1.25


class _PoolRouter(RequestRouter):
    """Pins calls that name a replica; ranks the others with ``rank``."""

    def initialize_state(self, pool: str) -> None:
        self.pool = pool
        register_router(pool, self)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new set of the pool's running replicas; sequences on one that left move."""
        before = {replica.unique_id for replica in self.curr_replicas}
        super().update_replicas(replicas)
        departed(before - {replica.unique_id for replica in self.curr_replicas})

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        departed([replica_id.unique_id])

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        return choose(candidate_replicas, pending_request, self.rank, self.pool)

    def rank(self, candidates: list[RunningReplica], kwargs: dict) -> list[list[RunningReplica]]:
        raise NotImplementedError

    def _loads(self, candidates: list[RunningReplica], kwargs: dict) -> dict:
        """Each candidate's load by replica id, as ranking weighs it (see ``adapter_loads``)."""
        return adapter_loads(candidates, {replica.replica_id: self._load(replica) for replica in candidates}, kwargs.get("lora"))

    def _load(self, replica: RunningReplica) -> int:
        """Requests in flight on the replica as Serve counts them (fresher than the stats)."""
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        if queue_len is not None:
            return queue_len
        stats = reported_stats(replica)
        return stats.scheduler.num_sequences if stats else 0


class PrefixAffinityRouter(_PoolRouter):
    """Prefill pool: the replica with the fewest prompt tokens to compute before this one's first
    token (those queued there, and this prompt's past the leading blocks it holds:
    ``rank_by_prefix``), unless it is busier than the least loaded replica by more than
    ``imbalance_threshold`` requests; otherwise the least loaded (ties broken at random)."""

    def initialize_state(self, pool: str, imbalance_threshold: int = IMBALANCE_THRESHOLD) -> None:
        super().initialize_state(pool)
        self.imbalance_threshold = imbalance_threshold

    def rank(self, candidates: list[RunningReplica], kwargs: dict) -> list[list[RunningReplica]]:
        loads = self._loads(candidates, kwargs)
        return rank_by_prefix(candidates, loads, kwargs.get("prefix_hashes") or [], kwargs.get("num_tokens", 0), self.imbalance_threshold)


def _leading_match(prefix_hashes: list[int], stats: ReplicaStats | None) -> int:
    if stats is None or not stats.prefix_hashes:
        return 0
    return held_blocks(prefix_hashes, set(stats.prefix_hashes))


class KVCapacityRouter(_PoolRouter):
    """Decode (or colocated) pool: replicas with room for the prompt's KV (``num_prompt_blocks``
    keyword) first, fewest running sequences first, most free blocks breaking ties; a context
    computed there (``prefix_hashes`` keyword: a colocated request, or a prompt prefilled locally)
    goes first to the replica with room holding the longest run of its leading blocks, unless it
    is busier than the least loaded by more than ``imbalance_threshold`` requests."""

    def initialize_state(self, pool: str, imbalance_threshold: int = IMBALANCE_THRESHOLD) -> None:
        super().initialize_state(pool)
        self.imbalance_threshold = imbalance_threshold

    def rank(self, candidates: list[RunningReplica], kwargs: dict) -> list[list[RunningReplica]]:
        loads = self._loads(candidates, kwargs)
        ranks = rank_by_capacity(candidates, loads, kwargs.get("num_prompt_blocks", 0))
        return prefix_first(ranks, loads, kwargs.get("prefix_hashes") or [], self.imbalance_threshold, kwargs.get("num_prompt_blocks", 0))


# What the routers decide, as functions of the candidates (whose ``routing_stats`` are their
# reported ``ReplicaStats``) and of their loads: tested without Serve.


def choose(
    candidates: list[RunningReplica], pending_request: PendingRequest | None,
    rank: Callable[[list[RunningReplica], dict], list[list[RunningReplica]]], role: str | None = None,
) -> list[list[RunningReplica]]:
    """A call pinned to a replica (``replica_id`` keyword) goes there, or to any replica when it
    is gone; the others go by ``rank`` among the replicas serving the pool's ``role`` (a replica
    serving the other one, ``duet.router.roles``, is passed by while any other is left), replicas
    that lost a worker last."""
    if not candidates:
        return []
    kwargs = pending_request.kwargs if pending_request is not None else {}
    if pending_request is not None:
        # Serve sleeps between rounds only when told to (its locality tiers set this); without
        # it a round that chooses nothing is retried at once, and this coroutine never awaits:
        # the routing loop would spin and starve every other call in the process.
        pending_request.routing_context.should_backoff = True
    pinned = kwargs.get("replica_id")
    if pinned is not None:
        chosen = [replica for replica in candidates if replica.replica_id.unique_id == pinned]
        return [chosen or candidates]
    # A replica that lost a worker refuses new sequences until Serve replaces it: pass it by.
    working = [replica for replica in candidates if (stats := reported_stats(replica)) is None or stats.worker_failure is None]
    if role is not None:
        working = [replica for replica in working if (stats := reported_stats(replica)) is None or stats.stage == role] or working
    avoid = kwargs.get("avoid")  # the replica sending the context's KV: another receives it, while one is left
    if avoid is not None:
        working = [replica for replica in working if replica.replica_id.unique_id != avoid] or working
    return rank(working or candidates, kwargs)


def adapter_loads(candidates: list[RunningReplica], loads: dict, lora: str | None) -> dict:
    """``loads`` with ``ADAPTER_LOAD_CREDIT`` off each replica that reported holding ``lora``."""
    if lora is None:
        return loads
    holders = {replica.replica_id for replica in candidates if (stats := reported_stats(replica)) is not None and lora in stats.lora.held}
    return {replica_id: load - ADAPTER_LOAD_CREDIT if replica_id in holders else load for replica_id, load in loads.items()}


def rank_by_prefix(
    candidates: list[RunningReplica], loads: dict, prefix_hashes: list[int], num_tokens: int, imbalance_threshold: int,
) -> list[list[RunningReplica]]:
    """The replica where the prompt's first token comes soonest first: the fewest prompt tokens
    queued there (its report's ``prompt_tokens_pending``, or where more its prompts in flight,
    ``loads``, at this one's size) plus those of this prompt
    (``num_tokens``) past the leading blocks it holds of ``prefix_hashes``; the least loaded
    (``loads`` by replica id) among equals. Unless its load passes the least loaded's by more
    than ``imbalance_threshold`` (reports are half a second old; loads are Serve's own): then
    all by load (ties broken at random).

    The queue counts because a prefix every prompt shares (a chat template's system prompt)
    made the one replica holding it take every prompt while its queue stayed within the margin:
    of two prefill replicas, one had 1.9 times the pool's mean queue over a multi-turn run. Costs
    within ``NEAR_COST`` of the lowest count as equal: a short prefix saves too little to send
    every prompt to its holder, and the other replica, once it computed one, holds it too."""
    by_load = sorted(candidates, key=lambda replica: (loads[replica.replica_id], random.random()))

    def cost(replica: RunningReplica) -> int:
        stats = reported_stats(replica)
        held = _leading_match(prefix_hashes, stats) * (stats.kv.block_size if stats is not None else 0)
        # Its queue: the last report's, or the prompts Serve counts in flight there at this one's
        # size where more (a report half a second old shows a replica idle that took a prompt since).
        queued = max(stats.scheduler.prompt_tokens_pending if stats is not None else 0, loads[replica.replica_id] * num_tokens)
        return queued + max(num_tokens - held, 0)

    costs = {replica.replica_id: cost(replica) for replica in by_load}
    lowest = min(costs.values())
    best = next(replica for replica in by_load if costs[replica.replica_id] <= lowest * NEAR_COST)  # the least loaded of the near-cheapest
    if best is by_load[0] or loads[best.replica_id] - loads[by_load[0].replica_id] > imbalance_threshold:
        return [[replica] for replica in by_load]
    return [[best], [replica for replica in by_load if replica is not best]]


def prefix_first(
    ranks: list[list[RunningReplica]], loads: dict, prefix_hashes: list[int], imbalance_threshold: int, num_prompt_blocks: int
) -> list[list[RunningReplica]]:
    """``rank_by_capacity``'s ``ranks`` with the replica holding the longest run of
    ``prefix_hashes`` first, where it has room for ``num_prompt_blocks`` and its load passes the
    least loaded's by ``imbalance_threshold`` at most (its history is then not recomputed)."""
    order = [rank[0] for rank in ranks]
    if not prefix_hashes or not order:
        return ranks
    best, best_match = None, 0
    for replica in order:
        stats = reported_stats(replica)
        if stats is not None and stats.kv.num_free_blocks < num_prompt_blocks:
            continue
        match = _leading_match(prefix_hashes, stats)
        if match > best_match:
            best, best_match = replica, match
    if best is None or loads[best.replica_id] - min(loads[replica.replica_id] for replica in order) > imbalance_threshold:
        return ranks
    return [[best]] + [[replica] for replica in order if replica is not best]


def rank_by_capacity(candidates: list[RunningReplica], loads: dict, num_prompt_blocks: int) -> list[list[RunningReplica]]:
    """Replicas with room for ``num_prompt_blocks`` first, then the least loaded, then the most
    free blocks (ties broken at random); a replica that has not reported goes by its load."""

    def key(replica: RunningReplica):
        stats = reported_stats(replica)
        free = stats.kv.num_free_blocks if stats else 0
        return (stats is not None and free < num_prompt_blocks, loads[replica.replica_id], -free, random.random())

    return [[replica] for replica in sorted(candidates, key=key)]
