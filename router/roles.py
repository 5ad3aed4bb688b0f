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
- **one role short**: decode is short when a decoding sequence waits for room or the TPOT
  target is passed, prefill when its queue passes what its replicas compute in half the TTFT
  target or first tokens are late. A replica of the short role away from home goes back (what
  it holds finishes there); otherwise the least loaded replica of the other role comes, if
  that role is spare: it keeps more than its minimum (``min_prefill``, ``min_decode``) and
  its load fits in one replica fewer at half its targets;
- **idle capacity** (``lend_idle``, off by default): a prefill replica with nothing to do, while
  prefill is spare and a replica serving decode runs two sequences or more past half the TPOT
  target, serves decode. On two cores it paid past capacity and cost goodput below it (#38's
  runs in docs/benchmarks.md);
- **back home**: a replica away whose role is spare (and not short) returns, one a round.

Replicas serving decode even out: when the busiest runs ``SHED_GAP`` sequences more than the
least busy and one of them serves away from home (one that just took the role, say), the
keeper has it ``shed`` half the difference to it by KV
(``decode_node.migration.Migration.shed``: those with the most to make first, each once at
most), once per ``hold_s``: the streams end with ``Moved`` naming the replica and its pool, and
their routers read on there. This is what lets a prefill replica's core help finish the
streams left when arrivals stop (the drain).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from duet.messages import ReplicaStats

logger = logging.getLogger("ray.serve")  # in the router's Serve log, beside the autoscalers' decisions

PLAN_EVERY_S = 0.5
ROLE_CALL_TIMEOUT_S = 10.0
# A role given by this router counts over the replica's report for this long at most (its next
# report, within the routing stats' period, tells the role it took).
ASSIGNED_TTL_S = 3.0
LOW_LOAD = 0.5  # a role is spare when one replica fewer would run below this fraction of its targets
STALE_S = 30.0  # a replica silent this long serves nothing (``serve_internals.POOL_DOWN_S``)
SHED_GAP = 3  # replicas serving decode whose running sequences differ by this much even out (by KV)
SHED_CALL_TIMEOUT_S = 60.0
ROLES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class RoleSettings:
    """The application's ``roles`` section (its defaults and checks are
    ``duet.cluster.config.RoleSettings``'): ``move``: roles follow load (off: each replica
    serves its pool's role only); ``lend_idle``: an idle prefill replica serves a busy decode
    role too (see ``plan``)."""

    move: bool
    lend_idle: bool
    min_prefill: int
    min_decode: int
    hold_s: float


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
        return self.stats.scheduler.num_sequences

    @property
    def prompt_tokens_pending(self) -> int:
        return self.stats.scheduler.prompt_tokens_pending if self.stats is not None else 0


@dataclasses.dataclass(frozen=True)
class Change:
    replica_id: str
    pool: str
    role: str
    reason: str
    urgent: bool = False  # taken without waiting out the replica's hold


def away_or_home(members: list[Member], home: str, load: Callable[[Member], int]) -> tuple[str, str | None]:
    """Where a call of the role ``members`` serve goes: ``(pool, replica_id)`` of the least
    loaded replica serving it away from its pool, when it is less loaded than every one at home
    (or none is); else ``(home, None)``, whose request router ranks."""
    away = [member for member in members if member.away]
    at_home = [load(member) for member in members if not member.away]
    if away:
        best = min(away, key=load)
        if not at_home or load(best) < min(at_home):
            return best.pool, best.replica_id
    return home, None


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
        self.wanted = asyncio.Event()  # set when a call finds no replica serving its role: plan now
        self._assigned: dict[str, tuple[str, float]] = {}  # replica id -> (role, when given)

    def want(self) -> None:
        """A call found no replica serving its role: the keeper plans at once, not at its next round."""
        self.wanted.set()

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


def _idle(member: Member) -> bool:
    stats = member.stats
    return stats is not None and not (stats.scheduler.num_running or stats.scheduler.num_waiting or stats.scheduler.prompt_tokens_pending)


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
        if not short[role] or short[other]:
            continue
        # A replica of the short role away from home goes back (its sequences finish there);
        # else the least loaded replica of the other role comes, if that role can spare one.
        returning = [member for member in serving[other] if member.pool == role]
        if returning or spare[other]:
            chosen = min(returning or serving[other], key=lambda member: member.load)
            return [Change(chosen.replica_id, chosen.pool, role, f"{role}_{short[role]}")]
    busy = any(member.load >= 2 and member.stats is not None and member.stats.load.tpot_s > LOW_LOAD * tpot_s for member in serving["decode"])
    idle = [member for member in serving["prefill"] if _idle(member)]
    if settings.lend_idle and not short["prefill"] and spare["prefill"] and busy and idle:
        # Idle capacity serves the other stage: the keeper then has busy decode replicas shed load to it.
        chosen = min(idle, key=lambda member: not member.away)
        return [Change(chosen.replica_id, chosen.pool, "decode", "prefill_idle")]
    for member in healthy:
        if member.away and spare[member.role] and not short[member.role]:
            return [Change(member.replica_id, member.pool, member.pool, "home")]
    return []


def shed_plan(members: list[Member]) -> tuple[Member, Member, int] | None:
    """Sequences to move by KV: first every decoding sequence left on a replica now serving
    prefill (a decode replica that took the prefill role, a prefill replica gone home) to the
    least busy replica serving decode, so its core goes to prompts; else between two replicas
    serving decode (the busiest to the least busy, half their difference in running sequences)
    when they differ by ``SHED_GAP`` or more and one of them serves away from home (it took the
    role, or goes home soon); replicas of the decode pool alone are evened out where sequences
    are placed (``KVCapacityRouter``)."""
    healthy = [member for member in members if member.stats is not None and member.stats.worker_failure is None]
    decoding = [member for member in healthy if member.role == "decode"]
    if not decoding:
        return None
    least = min(decoding, key=lambda member: member.stats.scheduler.num_running)
    leftovers = [member for member in healthy if member.role == "prefill" and member.stats.scheduler.num_decoding_blocks > 0]
    if leftovers:  # its prompts in flight cannot move and stay (``Migration.shed`` takes decoding sequences)
        source = max(leftovers, key=lambda member: member.stats.scheduler.num_decoding_blocks)
        return source, least, source.stats.scheduler.num_running
    if len(decoding) < 2:
        return None
    busiest = max(decoding, key=lambda member: member.stats.scheduler.num_running)
    gap = busiest.stats.scheduler.num_running - least.stats.scheduler.num_running
    return (busiest, least, gap // 2) if gap >= SHED_GAP and (busiest.away or least.away) else None


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
        self.shed = 0  # sequences moved to even out the replicas serving decode
        self._task: asyncio.Task | None = None
        self._shedding: asyncio.Task | None = None
        self._shed_at: dict[str, float] = {}  # replica id -> when it was last asked to shed

    def start(self) -> None:
        """Run on the current event loop, once."""
        if self._task is None and self.settings.move:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.view.wanted.wait(), PLAN_EVERY_S)
            except asyncio.TimeoutError:
                pass
            self.view.wanted.clear()
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
        self._maybe_shed()
        return taken

    def _maybe_shed(self) -> None:
        """Have the busiest replica serving decode move sequences to the least busy, once per
        ``hold_s`` at most and one request at a time (a move takes a transfer)."""
        if self._shedding is not None and not self._shedding.done():
            return
        moves = shed_plan(self.view.members())
        if moves is None:
            return
        busiest, least, count = moves
        now = time.monotonic()
        if now - self._shed_at.get(busiest.replica_id, -self.settings.hold_s) < self.settings.hold_s:
            return
        self._shed_at[busiest.replica_id] = now
        self._shedding = asyncio.get_running_loop().create_task(self._shed(busiest, least, count))

    async def _shed(self, busiest: Member, least: Member, count: int) -> None:
        self.new_call_context()
        call = self.pools[busiest.pool].shed.remote(least.pool, least.replica_id, count, replica_id=busiest.replica_id)
        try:
            self.shed += await asyncio.wait_for(call, SHED_CALL_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - the next round sees where things stand
            logger.warning("replica %s did not shed sequences to %s: %r", busiest.replica_id, least.replica_id, error)
