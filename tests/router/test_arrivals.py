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
    meter.arrive(100, 16)
    now[0] = 30.0
    meter.arrive(300, None)
    meter.finish(12)
    short, long = meter.summary()
    assert short == report(WINDOWS_S[0], 1, 300, 0, 1, 12)
    assert long == report(30.0, 2, 400, 16, 1, 12)  # as long as it has run
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
    assert (short["finished"], short["output_tokens"]) == (1, 3)
