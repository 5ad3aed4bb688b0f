"""A sequence's life as the router sees it: its phases, and what the failure policy does with
each failure in each phase (no Ray, no replica: the state machine alone)."""

from __future__ import annotations

import pytest

from duet.messages import EngineRequest
from duet.router.sequence import (
    FAILURE_POLICY,
    TRANSITIONS,
    Action,
    Failure,
    IllegalTransition,
    Phase,
    Sequence,
    TooManyMigrations,
)
from duet.sampling_params import SamplingParams


def _sequence(**kwargs) -> Sequence:
    return Sequence(EngineRequest("s", [1, 2, 3], SamplingParams(max_tokens=8)), **kwargs)


def _at(phase: Phase, **kwargs) -> Sequence:
    sequence = _sequence(**kwargs)
    sequence.phase = phase
    return sequence


def test_a_pd_sequence_goes_placing_prefilling_decoding_done():
    sequence = _sequence()
    for phase in (Phase.PREFILLING, Phase.DECODING, Phase.DONE):
        sequence.to(phase)
    assert sequence.phase is Phase.DONE and sequence.migrations == 0


def test_an_ended_sequence_goes_nowhere():
    for phase in (Phase.DONE, Phase.FAILED):
        with pytest.raises(IllegalTransition, match=f"{phase.value} -> decoding"):
            _at(phase).to(Phase.DECODING)
    with pytest.raises(IllegalTransition):
        _sequence().to(Phase.MOVING)  # nothing to move before it runs anywhere


def test_every_failure_of_a_running_phase_has_a_rule_and_every_rule_a_legal_outcome():
    running = [phase for phase, nexts in TRANSITIONS.items() if nexts]
    for phase in running:
        assert (phase, Failure.REPLICA_LOST) in FAILURE_POLICY and (phase, Failure.REFUSED) in FAILURE_POLICY
    for (phase, _), action in FAILURE_POLICY.items():
        outcome = {Action.FAIL: Phase.FAILED, Action.RECOMPUTE: Phase.RECOMPUTING, Action.COMPUTE_ON_DECODE: Phase.DECODING}[action]
        assert outcome in TRANSITIONS[phase], (phase, action)


def test_a_prefill_replica_that_fails_before_its_first_token_leaves_the_context_to_decode():
    sequence = _at(Phase.PREFILLING)
    assert sequence.failed(Failure.PREFILL_FAILED) is Action.COMPUTE_ON_DECODE
    assert sequence.phase is Phase.PREFILLING and sequence.migrations == 0
    sequence.to(Phase.DECODING)


def test_a_lost_decode_replica_recomputes_the_sequence_and_counts_a_migration():
    sequence = _at(Phase.DECODING)
    sequence.token_ids = [7, 8]
    assert sequence.failed(Failure.REPLICA_LOST) is Action.RECOMPUTE
    assert (sequence.phase, sequence.migrations) == (Phase.RECOMPUTING, 1)
    sequence.resumed()
    resumed = sequence.resumed(kv_receive=True)  # a second placement gets an id of its own
    assert (resumed.request_id, resumed.output_token_ids, resumed.kv_receive) == ("s.1", [7, 8], True)
    assert sequence.num_context_tokens == 3 + 1


def test_the_fail_policy_fails_a_prompts_own_lost_kv_but_recomputes_a_moved_sequences():
    """Guards a stream failed mid-way under ``on_transfer_failure: fail``: that policy is for a
    prompt's own KV; a sequence that moved and lost its KV is recomputed."""
    own = _at(Phase.DECODING, on_transfer_failure="fail")
    assert own.failed(Failure.KV_LOST) is Action.FAIL and own.phase is Phase.FAILED
    moved = _at(Phase.DECODING, on_transfer_failure="fail")
    moved.moved(by_kv=True)
    moved.to(Phase.DECODING)
    assert moved.failed(Failure.KV_LOST) is Action.RECOMPUTE
    assert _at(Phase.DECODING).failed(Failure.KV_LOST) is Action.RECOMPUTE  # the default policy


def test_a_move_past_max_migrations_fails_the_sequence():
    sequence = _at(Phase.DECODING, max_migrations=2)
    sequence.moved(by_kv=True)
    sequence.to(Phase.DECODING)
    sequence.moved(by_kv=False)
    assert (sequence.phase, sequence.migrations) == (Phase.RECOMPUTING, 2)
    sequence.to(Phase.DECODING)
    with pytest.raises(TooManyMigrations, match="max_migrations=2"):
        sequence.failed(Failure.REPLICA_LOST)
    assert sequence.phase is Phase.FAILED


def test_no_room_and_a_refused_request_fail_at_once():
    assert _sequence().failed(Failure.NO_ROOM) is Action.FAIL
    assert _at(Phase.PREFILLING).failed(Failure.REFUSED) is Action.FAIL
