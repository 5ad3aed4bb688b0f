"""The orchestrator's decode streams, against a pool handle that answers in this process."""

from __future__ import annotations

import asyncio

import pytest

import duet.router.pd as pd
from duet.messages import EngineRequest
from duet.sampling_params import SamplingParams


class _SilentStream:
    """A Serve streaming call that never answers (Serve lists no replica: it waits in the queue)."""

    def __init__(self) -> None:
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled = True


class _SilentPool:
    def __init__(self) -> None:
        self.calls: list[_SilentStream] = []
        self.generate = self

    def options(self, stream: bool):
        return self

    def remote(self, *args, **kwargs) -> _SilentStream:
        self.calls.append(_SilentStream())
        return self.calls[-1]


class _Orchestrator:
    def __init__(self, decode) -> None:
        self.decode = decode
        self.fired = []

    def fire(self, replica_id, call) -> None:
        self.fired.append(replica_id)


def test_a_placement_no_replica_answers_fails_in_bounded_time(monkeypatch):
    """Guards the clients of a pool whose last replica died: Serve, listing none, queues the call
    without limit, and the request hung (its admission held) until a replica came back, if ever."""
    monkeypatch.setattr(pd, "PLACE_WAIT_S", 0.2)
    pool = _SilentPool()
    orchestrator = _Orchestrator(pool)
    request = EngineRequest("waiting", [1, 2, 3], SamplingParams(max_tokens=4))

    async def run():
        stream = pd._DecodeStream(orchestrator, request)
        with pytest.raises(pd.PoolUnavailableError, match="no decode replica took this request"):
            await asyncio.wait_for(stream.place(), 5)
        await stream.aclose()

    asyncio.run(run())
    assert len(pool.calls) == 1 and pool.calls[0].cancelled
    assert orchestrator.fired == []  # it ran nowhere: nothing to abort
