"""``duet simulate``'s roles that move (``duet.router.roles``): which replicas serve each role, the
router's own ``plan`` every ``PLAN_EVERY_S`` on the replicas' last reports (a replica keeps a
role ``hold_s`` from its start or its last change, unless the change is urgent), and each call
routed as the router routes it (``away_or_home``: the least loaded replica serving the role away
from its pool when it is less loaded than every one at home, else the home pool's own ranking).
Without ``roles.move`` every replica serves its pool's role and only the routing remains.

The keeper's shedding (``shed_plan``) moves sequences by KV (``sim_moves``).
"""

from __future__ import annotations

from collections.abc import Callable

from duet.router.roles import PLAN_EVERY_S, Member, RoleSettings, away_or_home, plan, shed_plan


class Roles:
    """The roles of ``simulation``'s (a ``sim_run.Simulation``) replicas; ``changes``: (when,
    replica, role, reason) of each one taken."""

    def __init__(self, simulation, settings: RoleSettings | None, ttft_s: float, tpot_s: float) -> None:
        self.simulation, self.settings, self.ttft_s, self.tpot_s = simulation, settings, ttft_s, tpot_s
        self.changes: list[tuple[float, str, str, str]] = []

    def start(self) -> None:
        if self.settings is not None and self.settings.move:
            self.simulation.every(PLAN_EVERY_S, self._plan)

    def serving(self, role: str) -> list:
        """The replicas in a pool (not leaving) that serve ``role`` now."""
        simulation = self.simulation
        return [replica for replica in (*simulation.prefill, *simulation.decode) if replica.stage == role]

    def members(self) -> list[Member]:
        """Every replica in a pool as the router's ``RoleView`` lists it: its pool, its role, its last report."""
        simulation = self.simulation
        return [
            Member(replica.home, replica.name, replica.stage, simulation.reported.get(replica.name))
            for replica in (*simulation.prefill, *simulation.decode)
        ]

    def pick(self, role: str, load: Callable[[Member], int], rank: Callable, exclude=None):
        """The replica a call of ``role`` goes to: ``away_or_home`` on the members serving it, else
        the best by ``rank`` of its home pool's replicas serving it (of any serving it when its
        home pool has none left: the router finds the role through them); never ``exclude``
        (None when no other serves the role)."""
        replicas = {replica.name: replica for replica in self.serving(role) if replica is not exclude}
        members = [member for member in self.members() if member.role == role and member.replica_id in replicas]
        if members:
            _, replica_id = away_or_home(members, role, load)
            if replica_id is not None:
                return replicas[replica_id]
        home = [replica for replica in replicas.values() if replica.home == role]
        return min(home or list(replicas.values()), key=rank, default=None)

    def _plan(self) -> None:
        now = self.simulation.now
        by_name = {replica.name: replica for replica in (*self.simulation.prefill, *self.simulation.decode)}
        for change in plan(self.members(), self.settings, self.ttft_s, self.tpot_s):
            replica = by_name[change.replica_id]
            if change.urgent or now - replica.role_since >= self.settings.hold_s:
                replica.stage, replica.role_since = change.role, now
                self.changes.append((now, replica.name, change.role, change.reason))
                self.simulation.admit()  # contexts waiting may go
        moves = shed_plan(self.members())
        if moves is not None:
            busiest, least, count = moves
            self.simulation.moves.shed(by_name[busiest.replica_id], by_name[least.replica_id], count, self.settings.hold_s)
