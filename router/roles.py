"""Roles that move with load. Every replica of a PD application runs the same engine on the
same weights; its pool (its Serve deployment) is its home role, and it serves the other role
while its own has work to spare and the other one is short. A replica that changes role
keeps what it holds: a decode replica serving prefill finishes its streams, a prefill
replica serving decode keeps its prefix cache (it loaded no draft: it decodes without
speculation, token for token the same).

Who serves which role is the replica's own state (``EngineReplica.take_role``, which holds a
role ``hold_s`` at least), reported in its stats (``ReplicaStats.stage``): the pools' request
routers pass replicas serving the other role by, and the router's orchestrator and balancer
read the roles here (``RoleView``). The router's ``RoleKeeper`` plans every ``PLAN_EVERY_S``
from the replicas' reports (``plan``, at most one change a round) and asks the replica:

- **a role nobody serves**: the decode role with no live replica (its last one died or left)
  is taken at once, without waiting out the hold, by the least loaded replica serving prefill:
  decode replicas compute their own prompts, so the application answers again within
  seconds, not when Serve's replacement is up;
- **one role short, the other spare**: decode is short when a decoding sequence waits for room
  or the TPOT target is passed, prefill when its queue passes what its replicas compute in
  half the TTFT target or first tokens are late; the other role is spare when it keeps more
  than its minimum (``min_prefill``, ``min_decode``) and its load fits in one replica fewer at
  half its targets. A replica away from home goes back first; otherwise the least loaded
  replica of the spare role moves;
- **back home**: when neither role is short, a replica away from home returns, one a round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from duet.messages import ReplicaStats

logger = logging.getLogger(__name__)

PLAN_EVERY_S = 0.5
ROLE_CALL_TIMEOUT_S = 10.0
# A role given by this router counts over the replica's report for this long at most (its next
# report, within the routing stats' period, tells the role it took).
ASSIGNED_TTL_S = 3.0
LOW_LOAD = 0.5  # a role is spare when one replica fewer would run below this fraction of its targets
STALE_S = 30.0  # a replica silent this long serves nothing (``serve_internals.POOL_DOWN_S``)
ROLES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class RoleSettings:
    """``move``: roles follow load (off: each replica serves its pool's role only)."""

    move: bool = True
    min_prefill: int = 0
    min_decode: int = 1
    hold_s: float = 5.0


@dataclasses.dataclass(frozen=True)
class Member:
    """A running replica: its pool (its home role), the role it serves, its last report."""

    pool: str
    replica_id: str
    role: str
    stats: ReplicaStats | None

    @property
    def away(self) -> bool:
        return self.role != self.pool

    @property
    def load(self) -> int:
        if self.stats is None:
            return 0
        return self.stats.scheduler.num_running + self.stats.scheduler.num_waiting


@dataclasses.dataclass(frozen=True)
class Change:
    replica_id: str
    pool: str
    role: str
    reason: str
    urgent: bool = False  # taken without waiting out the replica's hold


class RoleView:
    """The running replicas of both pools and the role each serves, as this router knows them:
    ``members(pool)`` lists a pool's ``(replica_id, stats)`` (``serve_internals.pool_members``),
    ``pool_size(pool)`` its running replicas (None: not seen yet); a role this router gave a
    replica counts until its report tells it (``ASSIGNED_TTL_S``)."""

    def __init__(
        self, members: Callable[[str], list[tuple[str, ReplicaStats | None]]], pool_size: Callable[[str], int | None] = lambda pool: 0,
    ) -> None:
        self._members = members
        self._pool_size = pool_size
        self._assigned: dict[str, tuple[str, float]] = {}  # replica id -> (role, when given)

    def assign(self, replica_id: str, role: str) -> None:
        self._assigned[replica_id] = (role, time.time())

    def members(self) -> list[Member]:
        now = time.time()
        found = []
        for pool in ROLES:
            for replica_id, stats in self._members(pool):
                if stats is not None and now - stats.reported_at > STALE_S:
                    continue
                role = stats.stage if stats is not None else pool
                assigned = self._assigned.get(replica_id)
                if assigned is not None:
                    if now - assigned[1] > ASSIGNED_TTL_S or (stats is not None and stats.reported_at > assigned[1]):
                        del self._assigned[replica_id]
                    else:
                        role = assigned[0]
                found.append(Member(pool, replica_id, role, stats))
        return found

    def serving(self, role: str) -> list[Member]:
        return [member for member in self.members() if member.role == role]

    def stats(self, role: str) -> list[ReplicaStats]:
        """The reports of the replicas serving ``role`` (the balancer's view of a 'pool')."""
        return [member.stats for member in self.serving(role) if member.stats is not None]

    def size(self, role: str) -> int | None:
        """Replicas serving ``role``; None while nobody does and this process has not seen the
        pool of that role yet (before its first call)."""
        serving = len(self.serving(role))
        return None if serving == 0 and self._pool_size(role) is None else serving


def _short_and_spare(members: list[Member], ttft_s: float, tpot_s: float, settings: RoleSettings) -> tuple[dict, dict]:
    """Per role: whether it is short (with the reason), and whether it could give a replica."""
    prefill = [member.stats for member in members if member.role == "prefill" and member.stats is not None]
    decode = [member.stats for member in members if member.role == "decode" and member.stats is not None]
    counts = {role: sum(1 for member in members if member.role == role) for role in ROLES}
    rates = [stats.load.prefill_tokens_per_s for stats in prefill + decode if stats.load.prefill_tokens_per_s > 0]
    per_replica = (sum(rates) / len(rates)) * ttft_s / 2 if rates else 0.0
    # Prompts queued on prefill replicas, and new prompts decode replicas compute for want of prefill.
    backlog = sum(stats.scheduler.prompt_tokens_pending for stats in prefill)
    backlog += sum(stats.scheduler.new_prompt_tokens_pending for stats in decode)
    late = max((stats.load.ttft_s for stats in prefill), default=0.0)
    decoding = [stats for stats in decode if stats.scheduler.num_running > 0]
    waiting = sum(stats.scheduler.num_decode_waiting for stats in decode)
    tpot = max((stats.load.tpot_s for stats in decoding), default=0.0)
    short = {
        "prefill": "prompt_backlog" if per_replica and backlog > per_replica * max(counts["prefill"], 1)
        else "ttft" if counts["prefill"] and late > ttft_s else None,
        "decode": "waiting" if waiting else "tpot" if tpot > tpot_s else None,
    }
    blocks_used = sum(stats.kv.num_blocks - stats.kv.num_free_blocks for stats in decode)
    blocks = max((stats.kv.num_blocks for stats in decode), default=0)
    fewer = {role: counts[role] - 1 for role in ROLES}
    spare = {
        "prefill": counts["prefill"] > settings.min_prefill
        and backlog <= LOW_LOAD * per_replica * fewer["prefill"] and late <= LOW_LOAD * ttft_s,
        "decode": counts["decode"] > settings.min_decode and not waiting and tpot <= LOW_LOAD * tpot_s
        and blocks_used <= LOW_LOAD * blocks * fewer["decode"] and len(decoding) <= fewer["decode"],
    }
    return short, spare


def plan(members: list[Member], settings: RoleSettings, ttft_s: float, tpot_s: float) -> list[Change]:
    """The role changes to make now (at most one), from the running replicas and their reports."""
    if not settings.move:
        return []
    healthy = [member for member in members if member.stats is None or member.stats.worker_failure is None]
    serving = {role: [member for member in healthy if member.role == role] for role in ROLES}
    if not serving["decode"] and serving["prefill"]:
        chosen = min(serving["prefill"], key=lambda member: (not member.away, member.load))
        return [Change(chosen.replica_id, chosen.pool, "decode", "no_decode_replica", urgent=True)]
    short, spare = _short_and_spare(healthy, ttft_s, tpot_s, settings)
    for role, other in (("decode", "prefill"), ("prefill", "decode")):
        if short[role] and not short[other] and spare[other]:
            # The least loaded replica of the spare role: one away from home first (it goes back).
            chosen = min(serving[other], key=lambda member: (not member.away, member.load))
            return [Change(chosen.replica_id, chosen.pool, role, f"{role}_{short[role]}")]
    if not short["prefill"] and not short["decode"]:
        for member in healthy:
            if member.away and len(serving[member.role]) > (settings.min_prefill if member.role == "prefill" else settings.min_decode):
                return [Change(member.replica_id, member.pool, member.pool, "home")]
    return []


class RoleKeeper:
    """Plans roles every ``PLAN_EVERY_S`` and asks the replicas to take them: ``pools`` are the
    application's Serve handles by pool, whose ``take_role`` call is pinned to the replica by
    its ``replica_id`` keyword; ``new_call_context`` gives each call its own Serve request id."""

    def __init__(self, view: RoleView, pools: dict, settings: RoleSettings, ttft_s: float, tpot_s: float, new_call_context) -> None:
        self.view = view
        self.pools = pools
        self.settings = settings
        self.ttft_s = ttft_s
        self.tpot_s = tpot_s
        self.new_call_context = new_call_context
        self.changes: dict[str, int] = {}  # by reason, for /metrics
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Run on the current event loop, once."""
        if self._task is None and self.settings.move:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(PLAN_EVERY_S)
            try:
                await self.tick()
            except Exception as error:  # noqa: BLE001 - the next round plans again
                logger.warning("role planning failed: %r", error)

    async def tick(self) -> list[Change]:
        """One round: plan, and ask each chosen replica to take its role. What was taken."""
        taken = []
        for change in plan(self.view.members(), self.settings, self.ttft_s, self.tpot_s):
            self.new_call_context()
            hold_s = 0.0 if change.urgent else self.settings.hold_s
            call = self.pools[change.pool].take_role.remote(change.role, replica_id=change.replica_id, hold_s=hold_s)
            try:
                role = await asyncio.wait_for(call, ROLE_CALL_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - gone or busy: the next round sees it
                logger.warning("replica %s did not take the %s role (%s): %r", change.replica_id, change.role, change.reason, error)
                continue
            self.view.assign(change.replica_id, role)
            if role == change.role:
                self.changes[change.reason] = self.changes.get(change.reason, 0) + 1
                logger.info("replica %s (%s pool) now serves %s (%s)", change.replica_id, change.pool, role, change.reason)
                taken.append(change)
        return taken
