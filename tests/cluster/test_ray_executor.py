"""How a replica with several ranks combines their reports of KV transfers."""

from __future__ import annotations

from duet.cluster.ray_executor import RankReports
from duet.outputs import KVTransferResult


def test_a_transfer_ends_once_every_rank_reported_it_across_steps_and_failed_steps():
    """Guards a decode request waiting for good: a step that one rank failed dropped the reports
    the other ranks had polled in it (each is polled once), so its transfer never had them all."""
    reports = RankReports(world_size=2)
    sent = KVTransferResult(7, ok=True, first_token_id=42, num_bytes=100)
    reports.add([[sent], []])  # rank 1 failed this step: its own report comes with a later one
    assert reports.take() == []
    reports.add([[], [KVTransferResult(7, ok=True, num_bytes=100)]])
    assert reports.take() == [KVTransferResult(7, ok=True, first_token_id=42, num_bytes=200)]
    assert reports.take() == []


def test_a_transfer_that_ended_in_a_failed_step_is_reported_with_the_next():
    reports = RankReports(world_size=2)
    reports.add([[KVTransferResult(3, ok=True)], [KVTransferResult(3, ok=False, error="checksum")]])
    # The failed step raises before taking; the next one takes it.
    reports.add([[], []])
    (ended,) = reports.take()
    assert (ended.transfer_id, ended.ok, ended.error) == (3, False, "checksum")
