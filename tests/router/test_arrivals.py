"""What a router meters for the planning autoscaler: each sequence's arrival and prompt, and the
output of those that finish (not of those their clients left), over its windows."""

from __future__ import annotations

import asyncio

import duet.router.pd as pd
from duet.messages import Placement, TokenDelta
from duet.router.arrivals import WINDOWS_S, ArrivalMeter
from duet.sampling_params import SamplingParams
from tests.cluster.test_capacity import report
from tests.router.test_pd import _ScriptedPool


def test_the_arrival_meter_keeps_each_window_and_forgets_what_is_older():
    now = [0.0]
    meter = ArrivalMeter(clock=lambda: now[0])
    first = meter.arrive(100, 16)
    now[0] = 30.0
    second = meter.arrive(300, None)
    meter.progress(first, 12)
    meter.end(first, finished=True)
    meter.progress(second, 5)
    short, long = meter.summary()
    assert short == report(WINDOWS_S[0], 1, 300, 0, 1, 12, running=1, running_tokens=5, running_expected=10)
    assert long == report(30.0, 2, 400, 16, 1, 12, running=1, running_tokens=5, running_expected=10)  # as long as it has run
    third = meter.arrive(10, 16)
    meter.progress(third, 12)  # likely to end with 24, but it asked for 16 at most
    assert meter.summary()[0]["running_expected"] == 10 + 16
    meter.end(third, finished=False)
    meter.end(second, finished=False)  # its client left: no length counted
    assert meter.summary()[0] == report(WINDOWS_S[0], 2, 310, 16, 1, 12)
    now[0] = 100.0
    assert meter.summary()[1] == report(WINDOWS_S[1], 0, 0)
    assert not meter._arrivals and not meter._ends  # a router's memory stays bounded


def test_the_orchestrator_meters_each_sequence_and_the_length_of_those_that_finish():
    """Guards the planner's length mix: a sequence its client left is an arrival, but its output
    is not the length sequences end with."""
    ends = [TokenDelta("s", [5]), TokenDelta("s", [6, 7], finished=True, finish_reason="length")]
    pool = _ScriptedPool([Placement("y"), Placement("y")], [ends, [TokenDelta("t", [8]), TokenDelta("t", [9], finished=True)]])
    orchestrator = pd.Orchestrator(None, pool, 16, None)

    async def run():
        finished = [delta.token_ids async for delta in orchestrator.run("s", [1, 2, 3, 4], SamplingParams(max_tokens=3))]
        async for _ in orchestrator.run("t", [1, 2], SamplingParams(max_tokens=None)):
            break  # its client left
        return finished

    assert asyncio.run(run()) == [[5], [6, 7]]
    short, _ = orchestrator.arrivals.summary()
    assert (short["requests"], short["prompt_tokens"], short["max_tokens"]) == (2, 6, 3)
    assert (short["finished"], short["output_tokens"], short["running"]) == (1, 3, 0)


def test_a_sequence_in_flight_counts_its_tokens_so_far():
    pool = _ScriptedPool([Placement("y")], [[TokenDelta("s", [5, 6]), TokenDelta("s", [7], finished=True)]])
    orchestrator = pd.Orchestrator(None, pool, 16, None)

    async def run():
        seen = []
        async for _ in orchestrator.run("s", [1, 2], SamplingParams(max_tokens=8)):
            short, _ = orchestrator.arrivals.summary()
            seen.append((short["running"], short["running_tokens"], short["finished"]))
        return seen

    assert asyncio.run(run()) == [(1, 2, 0), (1, 3, 0)]
    assert orchestrator.arrivals.summary()[0]["finished"] == 1
