"""``duet simulate``'s sequences that move between replicas serving decode
(``decode_node.migration``), on the engine's own scheduler moves (``freeze``, ``migrate``):

- a replica leaving its pool (scaled down) moves every sequence it decodes, each once it is
  between two steps, by KV to the replica serving decode the decode pool's router would pick
  (a transfer of all its tokens but the last), or, in a colocated pool (no KV connector) or
  where no replica has room, by recompute there (prompt and outputs computed again); its
  prompts in flight for others finish where they are;
- the role keeper's shedding (``duet.router.roles.shed_plan``, once per ``hold_s`` for a
  replica): every decoding sequence off a replica now serving prefill, or half the difference
  from the busiest replica serving decode to the least busy where one of them is away from its
  pool; only sequences placed there afresh, with ``SHED_MIN_TOKENS`` still to make, the most
  first; one that finds no room stays.

A move waits for its replica's step to end (the engine freezes a sequence between steps).
"""

from __future__ import annotations

from duet.decode_node.migration import SHED_MIN_TOKENS


class Moves:
    """The moves of ``simulation``'s (a ``sim_run.Simulation``) sequences; ``counts``: the moves
    made, by why and how."""

    def __init__(self, simulation) -> None:
        self.simulation = simulation
        self.counts = {"leave_kv": 0, "leave_recompute": 0, "shed": 0}
        self._moved: set[str] = set()  # sequences moved once: not shed again
        self._pending: dict[str, list[tuple[str, object]]] = {}  # replica name -> (request id, destination) after its step
        self._shed_at: dict[str, float] = {}  # replica name -> when it last shed

    def leave(self, replica) -> None:
        """``replica`` left its pool: its sequences move as its steps let them."""
        if not replica.busy:
            self.after_step(replica)

    def shed(self, busiest, least, count: int, hold_s: float) -> None:
        """``count`` of ``busiest``'s sequences to ``least`` (``shed_plan``'s), once per ``hold_s``."""
        now = self.simulation.now
        if now - self._shed_at.get(busiest.name, -hold_s) < hold_s:
            return
        self._shed_at[busiest.name] = now
        requests = busiest.scheduler.requests

        def remaining(request) -> int:
            return request.sampling_params.max_tokens - request.num_output_tokens

        fresh = [
            request for request in requests.values()
            if request.kv_send is None and request.request_id not in self._moved and remaining(request) >= SHED_MIN_TOKENS
        ]
        chosen = sorted(fresh, key=remaining, reverse=True)[:count]
        self._pending.setdefault(busiest.name, []).extend((request.request_id, least) for request in chosen)
        if not busiest.busy:
            self.after_step(busiest)

    def after_step(self, replica) -> None:
        """Between two of ``replica``'s steps: the moves waiting for it, and, while it leaves, every
        sequence it decodes that can move now."""
        for request_id, to in self._pending.pop(replica.name, []):
            if self._move(replica, request_id, to):
                self.counts["shed"] += 1
        if replica in self.simulation.draining:
            for request in list(replica.scheduler.requests.values()):
                if request.kv_send is None:
                    self._leave_with(replica, request.request_id)

    def _leave_with(self, replica, request_id: str) -> None:
        simulation = self.simulation
        to = simulation.decode_replica(exclude=replica)
        if to is None:  # no other replica serves decode: it stays (Serve's shutdown would end it)
            return
        if not simulation.cluster.colocated and self._move(replica, request_id, to):
            self.counts["leave_kv"] += 1
            return
        held = replica.scheduler.freeze(request_id)
        if held is None:  # not between two decode steps yet: after its next
            return
        request = replica.scheduler.requests[request_id]
        replica.scheduler.abort(request_id)
        to.scheduler.add_request(_resumed(request, held))
        self.counts["leave_recompute"] += 1
        self._moved.add(request_id)
        simulation.kick(to)

    def _move(self, replica, request_id: str, to) -> bool:
        """One sequence from ``replica`` to ``to`` by KV; whether it went (not between two decode
        steps, or no room there: it stays)."""
        from duet.messages import KVDestination

        simulation = self.simulation
        held = replica.scheduler.freeze(request_id)
        if held is None:
            return False
        request = replica.scheduler.requests[request_id]
        transfer_id = simulation.new_transfer_id()
        if not to.scheduler.add_remote_request(_resumed(request, held), transfer_id):
            replica.scheduler.unfreeze(request_id)
            return False
        replica.scheduler.migrate(request_id, KVDestination(transfer_id, (), "decode"))
        self._moved.add(request_id)
        simulation.send_kv(replica, to, transfer_id, len(request.prompt_token_ids) + len(held) - 1)
        return True


def _resumed(request, held: list[int]):
    """The sequence as it goes on elsewhere: its prompt, the outputs it has (the router sends
    them), its parameters."""
    from duet.request import Request

    return Request(request.request_id, request.prompt_token_ids, request.sampling_params, None, output_token_ids=held,
                   arrival_time=request.arrival_time)
