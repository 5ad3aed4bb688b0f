"""One sequence's life in the router, as a state machine: where it is, and what is done when
something fails under it. ``Orchestrator.run`` (``duet.router.pd``) makes the calls; this
module decides, and knows nothing of Serve.

    PLACING ──▶ PREFILLING ──▶ DECODING ──▶ DONE
       │             │  ▲          │  ▲
       │             ▼  │          ▼  │
       │        (compute it on   MOVING (its replica left; its KV went ahead)
       │         decode: DECODING) │
       ▼             ▼             ▼
     FAILED ◀── RECOMPUTING ◀──────┘  (started over elsewhere from its prompt and tokens so far)

A failure is classified (``Failure``), and ``FAILURE_POLICY`` says, per phase, what follows:
recompute the sequence elsewhere, compute its context on the decode replica, or fail it. Two
rules sit beside the table: ``on_transfer_failure: fail`` fails a sequence whose own prompt's
KV was lost (not one already moved or started over, which is recomputed whatever the policy),
and a sequence that would move more than ``max_migrations`` times fails.
"""

from __future__ import annotations

import dataclasses
import enum

from duet.messages import EngineRequest


class Phase(enum.Enum):
    PLACING = "placing"  # asking a decode replica for room, first time
    PREFILLING = "prefilling"  # the prefill pool computes its context; its KV streams to the decode replica
    DECODING = "decoding"  # streaming from a decode replica
    MOVING = "moving"  # its replica left and shipped its KV: attaching where it went
    RECOMPUTING = "recomputing"  # placed anew with its tokens so far, its KV computed again
    DONE = "done"
    FAILED = "failed"


TRANSITIONS = {
    Phase.PLACING: {Phase.PREFILLING, Phase.DECODING, Phase.RECOMPUTING, Phase.FAILED},
    Phase.PREFILLING: {Phase.DECODING, Phase.DONE, Phase.RECOMPUTING, Phase.FAILED},
    Phase.DECODING: {Phase.DONE, Phase.MOVING, Phase.RECOMPUTING, Phase.FAILED},
    Phase.MOVING: {Phase.DECODING, Phase.RECOMPUTING, Phase.FAILED},
    Phase.RECOMPUTING: {Phase.PREFILLING, Phase.DECODING, Phase.RECOMPUTING, Phase.FAILED},
    Phase.DONE: set(),
    Phase.FAILED: set(),
}


class Failure(enum.Enum):
    REPLICA_LOST = "replica_lost"  # the decode replica (or one of its workers) died, or is gone
    KV_LOST = "kv_lost"  # the sequence's KV did not arrive on its decode replica
    PREFILL_FAILED = "prefill_failed"  # the prefill replica failed before its first token
    REFUSED = "refused"  # the request itself is wrong, or failed in the engine: no replica would do better
    NO_ROOM = "no_room"  # no decode replica took it in time


class Action(enum.Enum):
    RECOMPUTE = "recompute"
    COMPUTE_ON_DECODE = "compute_on_decode"
    FAIL = "fail"


FAILURE_POLICY = {
    (Phase.PLACING, Failure.REPLICA_LOST): Action.RECOMPUTE,
    (Phase.PLACING, Failure.NO_ROOM): Action.FAIL,
    (Phase.PLACING, Failure.REFUSED): Action.FAIL,
    (Phase.PREFILLING, Failure.PREFILL_FAILED): Action.COMPUTE_ON_DECODE,
    (Phase.PREFILLING, Failure.REPLICA_LOST): Action.RECOMPUTE,
    (Phase.PREFILLING, Failure.KV_LOST): Action.RECOMPUTE,
    (Phase.PREFILLING, Failure.NO_ROOM): Action.FAIL,
    (Phase.PREFILLING, Failure.REFUSED): Action.FAIL,
    (Phase.DECODING, Failure.REPLICA_LOST): Action.RECOMPUTE,
    (Phase.DECODING, Failure.KV_LOST): Action.RECOMPUTE,
    (Phase.DECODING, Failure.REFUSED): Action.FAIL,
    (Phase.MOVING, Failure.REPLICA_LOST): Action.RECOMPUTE,
    (Phase.MOVING, Failure.KV_LOST): Action.RECOMPUTE,
    (Phase.MOVING, Failure.REFUSED): Action.FAIL,
    (Phase.RECOMPUTING, Failure.REPLICA_LOST): Action.RECOMPUTE,
    (Phase.RECOMPUTING, Failure.KV_LOST): Action.RECOMPUTE,
    (Phase.RECOMPUTING, Failure.PREFILL_FAILED): Action.COMPUTE_ON_DECODE,
    (Phase.RECOMPUTING, Failure.NO_ROOM): Action.FAIL,
    (Phase.RECOMPUTING, Failure.REFUSED): Action.FAIL,
}


class IllegalTransition(RuntimeError):
    pass


class TooManyMigrations(RuntimeError):
    pass


@dataclasses.dataclass
class Sequence:
    """What the router knows of one sequence: its phase, and enough to start it over anywhere."""

    request: EngineRequest  # as the client asked it; its id names the sequence
    max_migrations: int = 3
    on_transfer_failure: str = "recompute"
    phase: Phase = Phase.PLACING
    token_ids: list[int] = dataclasses.field(default_factory=list)  # sent to the client so far
    migrations: int = 0
    placements: int = 0

    @property
    def num_context_tokens(self) -> int:
        """Tokens whose KV a (re)start computes: the prompt and all outputs but the last."""
        return len(self.request.prompt_token_ids) + max(0, len(self.token_ids) - 1)

    def context_token_ids(self) -> list[int]:
        """Those tokens (what its replica holds the KV of once it ended)."""
        return self.request.prompt_token_ids + self.token_ids[:-1]

    def resumed(self, kv_receive: bool = False, kv_receive_tokens: int | None = None) -> EngineRequest:
        """The sequence with its tokens so far, to place anew: under an id of its own each
        time, so that an earlier placement's tear-down (a cancel or an abort still on its way to
        the same replica) cannot touch this one. ``kv_receive_tokens``: a pull's (``EngineRequest``)."""
        self.placements += 1
        request_id = self.request.request_id
        if self.placements > 1:
            request_id = f"{request_id}.{self.placements - 1}"
        return dataclasses.replace(
            self.request, request_id=request_id, output_token_ids=list(self.token_ids), kv_receive=kv_receive,
            kv_receive_tokens=kv_receive_tokens,
        )

    def to(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"{self.request.request_id}: {self.phase.value} -> {phase.value}")
        self.phase = phase

    def moved(self, by_kv: bool) -> None:
        """Its replica left: to where its KV went (``by_kv``), else recomputed elsewhere."""
        self._migrate(Phase.MOVING if by_kv else Phase.RECOMPUTING)

    def failed(self, failure: Failure) -> Action:
        """What follows ``failure`` in the current phase (and the phase it leads to). Raises
        ``TooManyMigrations`` when recomputing would pass ``max_migrations``."""
        action = FAILURE_POLICY.get((self.phase, failure), Action.FAIL)
        if failure is Failure.KV_LOST and self.on_transfer_failure == "fail" and not self.migrations:
            action = Action.FAIL  # the policy is for a prompt's own KV
        if action is Action.FAIL:
            self.to(Phase.FAILED)
        elif action is Action.RECOMPUTE:
            self._migrate(Phase.RECOMPUTING)
        return action

    def _migrate(self, phase: Phase) -> None:
        self.to(phase)
        self.migrations += 1
        if self.migrations > self.max_migrations:
            self.phase = Phase.FAILED
            raise TooManyMigrations(
                f"the sequence had to move to another decode replica once more than router.max_migrations={self.max_migrations} "
                "allows; retry it"
            )
