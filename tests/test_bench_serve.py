"""``duet bench serve``'s summary: goodput over the whole run, and the drain that ends it."""

from __future__ import annotations

import pytest

from duet.benchmarks.serve import RequestResult, format_table, summarise


def test_the_summary_splits_the_run_into_arrivals_and_the_drain_after_the_last():
    """Guards the comparison of PD with colocation at 4 req/s, where every request met its SLO in
    both and the goodputs still differed by 3%: the layouts differed only in how long they took to
    finish what was left after the last arrival, which the summary did not show."""
    results = [
        RequestResult(ok=True, sent_s=0.0, ttft=0.5, e2e=1.5, output_tokens=11),
        RequestResult(ok=True, sent_s=1.0, ttft=2.5, e2e=3.0, output_tokens=11),  # past the 2 s TTFT target
        RequestResult(ok=False, sent_s=2.0, error="HTTP 503"),
    ]
    summary = summarise("pd", "random", results, duration=4.5, slo_ttft=2.0, slo_tpot=0.2)
    assert summary.drain_s == pytest.approx(2.5)
    assert summary.goodput == pytest.approx(1 / 4.5) and summary.request_throughput == pytest.approx(2 / 4.5)
    assert [row["sent_s"] for row in summary.requests] == [0.0, 1.0, 2.0]
    assert [row["ok"] for row in summary.requests] == [True, True, False]
    assert summary.requests[0]["tpot_ms"] == pytest.approx(100.0) and summary.requests[1]["ttft_ms"] == pytest.approx(2500.0)
    header, row = format_table([summary]).splitlines()
    assert "drain s" in header and "   2.50 " in row


def test_autoscale_phases_take_a_rate_or_a_closed_loop():
    from duet.benchmarks.autoscale import Phase, parse_phases

    assert parse_phases("prompts:120:c6:1400:1,gen:60:2.5:32:256") == [
        Phase("prompts", 120.0, 0.0, 1400, 1, concurrency=6), Phase("gen", 60.0, 2.5, 32, 256),
    ]
