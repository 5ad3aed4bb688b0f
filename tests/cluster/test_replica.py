"""The replica class's own bookkeeping, driven without Serve: a real engine (the tiny Llama,
with a KV connector, as a decode replica has) behind a real engine thread."""

from __future__ import annotations

import asyncio
import time

import pytest

from duet.cluster.replica import EngineReplica, _request_id
from duet.config import EngineArgs
from duet.engine import LLMEngine
from duet.engine_loop import EngineLoop
from duet.messages import EngineRequest
from duet.sampling_params import SamplingParams


@pytest.fixture
def replica(tiny_llama_dir):
    """An ``EngineReplica`` with only what adding and aborting sequences use: its engine, loop and tasks."""
    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=64, kv_transfer_config={"name": "decode-test"}))
    replica = object.__new__(EngineReplica)
    replica.engine = engine
    replica._tasks = set()
    replica.loop = EngineLoop(engine.step, _request_id, engine.has_unfinished_requests, name="test-replica-loop")
    yield replica
    replica.loop.stop()
    engine.close()


def test_a_placement_cancelled_while_the_engine_is_busy_frees_its_reserved_blocks(replica):
    """Guards a leak the ten-minute soak found: a router cancelled (its client gone) while the
    decode replica's engine thread was mid-step; the replica stopped listening, but the engine
    added the sequence after that step all the same and reserved its prompt's blocks for KV
    that never came (for ten minutes). Now the cancelled add is followed by an abort."""
    engine = replica.engine
    request = EngineRequest("cancelled", list(range(100, 420)), SamplingParams(temperature=0.0, max_tokens=8), kv_receive=True)

    async def run():
        replica.loop.call_soon(time.sleep, 0.5)  # a long step: the add waits behind it
        adding = asyncio.create_task(replica._add(request))
        await asyncio.sleep(0.1)
        adding.cancel()
        with pytest.raises(asyncio.CancelledError):
            await adding
        return await replica.loop.call(lambda: (dict(engine.scheduler.requests), engine.kv_cache_manager.num_free_blocks))

    requests, free_blocks = asyncio.run(run())
    assert (requests, free_blocks) == ({}, engine.num_blocks)
    engine.check_integrity()
