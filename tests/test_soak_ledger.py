"""The soak's ledger: the router's counts against what the clients saw."""

from __future__ import annotations

from types import SimpleNamespace

from duet.benchmarks.soak_ledger import Ledger, Outcome


def _ledger(rejections_counted: int, cancelled_plain: int, cancelled_streams: int) -> Ledger:
    ledger = Ledger({"duet:requests_rejected_total": {}, "vllm:request_success_total": {}})
    ledger.counters_after = {"duet:requests_rejected_total": {'model_name="m",status="429"': float(rejections_counted)}}
    jobs = [(True, "rejected")] * 2 + [(False, "cancelled")] * cancelled_plain + [(True, "cancelled")] * cancelled_streams
    for index, (stream, status) in enumerate(jobs):
        ledger.jobs[index] = SimpleNamespace(stream=stream, n=1)
        ledger.outcomes.append(Outcome(index, 0.0, status=status, http_status=429 if status == "rejected" else 200))
    return ledger


def test_a_plain_request_given_up_on_may_have_been_refused_meanwhile():
    """Guards a flaky soak: a plain request cancelled by its client after 0.1 s was refused by a
    router that answered later; the 429 counted there was never seen by the client."""
    assert _ledger(rejections_counted=3, cancelled_plain=1, cancelled_streams=0).server_mismatches() == []
    assert _ledger(rejections_counted=3, cancelled_plain=0, cancelled_streams=1).server_mismatches() != []  # a stream was admitted
    assert _ledger(rejections_counted=1, cancelled_plain=1, cancelled_streams=0).server_mismatches() != []  # fewer than seen
