"""Which replica a router's call goes to, where its pool's request router does not decide
alone: a sequence's placement (``decode``), the replica holding its history (``holder``) and a
context's prefill (``prefill``). With roles that move with load (``duet.router.roles``), a
replica serving a role away from its pool takes that role's calls when it is the least
loaded; a holder takes its history's next turn unless it is busier than the least loaded
replica serving decode by more than the pools' routers allow."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection

from duet.router.held import Holder
from duet.router.roles import RoleView, away_or_home
from duet.router.routing import IMBALANCE_THRESHOLD
from duet.router.serve_internals import pool_members


class Targets:
    """``decode_pool``: the pool sequences decode in ("decode", or "colocated"); ``roles``: who
    serves which role (None: each pool serves its own); ``open_streams``: the router's streams
    not yet finished (``DecodeStream``, each naming the replica it is headed to)."""

    def __init__(self, decode_pool: str, roles: RoleView | None, open_streams: Callable[[], Collection]) -> None:
        self.decode_pool = decode_pool
        self.roles = roles
        self.open_streams = open_streams

    def decode(self) -> tuple[str | None, str | None]:
        """Where a sequence is placed: ``(pool, None)``, the pool whose request router ranks its
        replicas; ``(pool, replica_id)``, a replica serving decode away from its pool, less
        loaded than every decode replica at home; ``(None, None)``: none serves decode now
        while a replica could take the role (the ``RoleKeeper`` gives it within a round)."""
        if self.roles is None:
            return self.decode_pool, None
        members = self.roles.serving("decode")
        if not members:
            return (None, None) if self.roles.serving("prefill") else (self.decode_pool, None)
        return away_or_home(members, self.decode_pool, lambda member: member.load)

    def holder(self, holder: Holder) -> tuple[str, str] | None:
        """``(pool, replica_id)`` of the replica ``holder`` names (where a context's history
        ended), unless it serves decode no more or its load passes the least loaded replica's
        serving decode by more than ``IMBALANCE_THRESHOLD`` (the rule the pools' routers apply
        to the prefixes replicas report): None, and ``decode`` places it. A load is the
        replica's last report's, or the sequences this router has open there or being placed
        there where more (a burst of turns held by one replica comes faster than its reports,
        and faster than its placements)."""
        if self.roles is not None:
            reported = {member.replica_id: member.load for member in self.roles.serving("decode")}
        else:
            members = pool_members(holder.pool)
            reported = {replica_id: stats.scheduler.num_sequences if stats else 0 for replica_id, stats in members}
        if holder.replica_id not in reported and (self.roles is not None or reported):
            return None  # serving prefill now, or gone
        own = Counter(replica_id for stream in self.open_streams() if (replica_id := stream.headed_to()) is not None)
        loads = {replica_id: max(load, own[replica_id]) for replica_id, load in reported.items()}
        load = loads.get(holder.replica_id, own[holder.replica_id])
        if loads and load - min(loads.values()) > IMBALANCE_THRESHOLD:
            return None
        return holder.pool, holder.replica_id

    def prefill(self) -> tuple[str, str | None]:
        """Where a context is computed for the decode replica that reserved its blocks: the
        prefill pool (prefix affinity ranks it), or a decode replica serving prefill with less
        queued than every prefill replica at home."""
        if self.roles is None:
            return "prefill", None
        members = self.roles.serving("prefill")
        if not members:
            return "prefill", None
        return away_or_home(members, "prefill", lambda member: member.prompt_tokens_pending)
