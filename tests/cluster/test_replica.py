"""The replica class's own bookkeeping, driven without Serve: replicas built from their parts
(a real engine of the tiny Llama, with a KV connector as a decode replica has, and peers that
call the other replica of a pair directly) behind real engine threads."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from duet.messages import EngineRequest
from duet.sampling_params import SamplingParams
from tests.cluster.replica_pair import attached, placed, read_stream, settled


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


def test_the_replicas_kv_transfers_wake_its_engine_loop(replica):
    """A decode replica's engine waits for a prompt's KV by stepping every ``BUSY_POLL_S``; the
    end of each transfer, sent or received, wakes its loop at once (``KVConnectorWorker.on_results``)."""
    connector = replica.engine.executor.worker.kv_connector
    assert connector.receiver.on_report == replica.loop.wake and connector.sender.on_report == replica.loop.wake


def test_a_stream_closed_while_its_sequence_moves_by_kv_frees_it_on_the_new_replica(decode_pair):
    """Guards the leak a review found: a sequence moved by KV off a leaving replica, its client
    gone before the router read where it went; the abort reached the old replica alone, and the
    new one decoded it on, into a queue nobody read, its blocks taken until the attach timed out."""
    leaving, staying = decode_pair
    params = SamplingParams(temperature=0.0, max_tokens=400, min_tokens=400)

    async def run():
        stream = await placed(leaving, EngineRequest("moving", list(range(100, 140)), params))
        while leaving.engine.scheduler.requests["moving"].num_output_tokens < 5:
            await anext(stream)
        leaving.draining = True
        await leaving.migration.move("moving", by_kv=True)
        assert "moving" in staying.migration.adopted
        await stream.aclose()  # the client left before reading the move
        return await settled(staying), await settled(leaving), dict(staying.migration.adopted)

    staying_state, leaving_state, adopted = asyncio.run(run())
    assert staying_state == ({}, staying.engine.num_blocks) and adopted == {}
    assert leaving_state == ({}, leaving.engine.num_blocks)
    staying.engine.check_integrity()


def test_a_leaving_replica_waits_for_the_sequences_moved_to_it_before_it_is_done(decode_pair):
    """Guards a sequence lost to a replica already gone: two replicas left together, one had
    reserved a sequence the other moved to it, and its drain, counting only attached streams,
    ended at once; the router then attached the sequence to it, and nothing moved it again."""
    leaving, staying = decode_pair
    request = EngineRequest("adopted", list(range(100, 140)), SamplingParams(temperature=0.0, max_tokens=8), output_token_ids=[7],
                            kv_receive=True)

    async def run():
        await staying.reserve(request)
        departed = asyncio.Event()
        departed.set()
        drain = asyncio.create_task(staying._leave_when_departed(departed))
        await asyncio.sleep(0.3)
        waited = not drain.done()
        await staying.abort("adopted", "staying")  # its mover gave it up: nothing left to wait for
        await asyncio.wait_for(drain, 5)
        return waited

    assert asyncio.run(run())

def test_a_seeded_sequence_moved_by_kv_while_speculating_goes_on_as_if_it_had_stayed(speculating_pair):
    """Guards a seeded stream across a move (#12): speculation drew its random numbers per step,
    not per token, so the new replica, advancing a fresh generator one draw per token so far,
    went on with another stream than the one it would have had."""
    leaving, staying = speculating_pair
    prompt, params = list(range(100, 140)), SamplingParams(temperature=0.8, max_tokens=48, min_tokens=48, seed=5)

    async def run():
        undisturbed, _ = await read_stream(await placed(staying, EngineRequest("undisturbed", prompt, params)))
        stream = await placed(leaving, EngineRequest("moving", prompt, params))
        while leaving.engine.scheduler.requests["moving"].num_output_tokens < 9:
            await anext(stream)
        leaving.draining = True
        await leaving.migration.move("moving", by_kv=True)
        before, moved = await read_stream(stream)
        after, _ = await read_stream(attached(staying, "moving", "staying"))
        return undisturbed, moved, after

    undisturbed, moved, after = asyncio.run(run())
    assert moved is not None and moved.replica_id == "staying" and len(moved.token_ids) >= 9
    assert moved.token_ids + after == undisturbed
    stats = staying.engine.stats()
    assert stats.spec.num_accepted_tokens > 0, stats
    staying.engine.check_integrity()

_OPENMP_THREADS = """
import asyncio, os, sys, threading
import torch
from duet.cluster.replica import EngineReplica, build_engine
from duet.config import EngineArgs
from duet.decode_node.role import DecodeRole
from duet.engine import LLMEngine
from duet.messages import EngineRequest
from duet.sampling_params import SamplingParams

args = {"model": sys.argv[1], "num_kv_blocks": 64}
if sys.argv[2] == "build_engine":
    engine, thread = build_engine(args, 2, "decode-loop")
else:  # built on this thread, stepped on the loop's
    torch.set_num_threads(2)
    engine, thread = LLMEngine(EngineArgs(**args)), None
replica = EngineReplica("r", DecodeRole(colocated=True), engine, thread=thread)

async def generate():
    outputs = replica.loop.subscribe("a")
    await replica.loop.call(engine.add_request, EngineRequest("a", list(range(100, 400)), SamplingParams(temperature=0.0, max_tokens=8)))
    while not (await outputs.get()).finished:
        pass

asyncio.run(generate())
python_threads = {thread.native_id for thread in threading.enumerate()}
print(len([task for task in os.listdir("/proc/self/task") if int(task) not in python_threads]))
replica.loop.stop()
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_served_engine_is_built_on_the_thread_that_steps_it_so_the_process_holds_one_openmp_pool(tiny_llama_dir):
    """Guards a served engine's speed: an engine built on Serve's thread and stepped on its
    loop's gave the process two OpenMP pools (libgomp keeps one per thread that ran a parallel
    region) for two cores, and libgomp then stops spinning at barriers: every region's threads
    slept and woke (150,000 times in 45 s at 2 req/s), and TPOT p50 was 1.2x and TTFT p50 1.3x
    (docs/benchmarks.md, 2026-12-03). Counted here: threads Python does not know of, after a
    generation, with the engine built by ``build_engine`` and as it was built before."""
    env = os.environ | {"OMP_NUM_THREADS": "2"}

    def native_threads(way: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _OPENMP_THREADS, str(tiny_llama_dir), way], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    one_thread, two_threads = native_threads("build_engine"), native_threads("two threads")
    assert one_thread == two_threads - 1, f"{one_thread} threads outside Python with build_engine, {two_threads} without"


@pytest.mark.parametrize("pull", [False, True], ids=["computed-past-history", "pulled"])
def test_a_busy_decode_replica_sends_a_turn_past_the_history_it_holds_to_another(decode_pair, tiny_llama_dir, pull):
    """#40: the decode replica that decoded a reply holds the conversation's history; too busy to
    decode the next turn too, it computes only the turn's new tokens past that history (its
    prefix cache's hit) and sends the whole context's KV to the replica that decodes it
    (``generate(from_history=True)``, in the decode role, beside its live stream), or (a pull)
    sends the history's full blocks and one token more, the receiver computing the rest and the
    first token: the turn's tokens are transformers' greedy ones, and both replicas end with
    every block free. Without ``from_history`` the decode role refuses the call, as before."""
    from duet.errors import ReplicaFullError
    from tests.reference import hf_greedy

    holder, other = decode_pair
    greedy = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    first_turn = list(range(100, 180))

    async def run():
        reply, _ = await read_stream(await placed(holder, EngineRequest("turn-1", first_turn, greedy)))
        busy = await placed(holder, EngineRequest("busy", list(range(300, 340)), SamplingParams(temperature=0.0, max_tokens=300, min_tokens=300)))
        await anext(busy)
        context = first_turn + reply + list(range(200, 216))
        pulled = (len(first_turn) + len(reply) - 1) // 16 * 16 + 1 if pull else None
        received = EngineRequest("turn-2", context, greedy, kv_receive=True, kv_receive_tokens=pulled)
        placement = await other.reserve(received, -(-len(context) // 16))
        sent = EngineRequest("turn-2", context[:pulled], greedy, kv_send=placement.destination)
        with pytest.raises(ReplicaFullError, match="serves the decode role"):
            [delta async for delta in holder.generate(sent)]
        hits_before = holder.engine.kv_cache_manager.prefix_cache_hits
        first = [delta async for delta in holder.generate(sent, from_history=True)]
        hits = holder.engine.kv_cache_manager.prefix_cache_hits - hits_before
        rest, _ = await read_stream(attached(other, "turn-2"))
        await busy.aclose()
        tokens = rest if pull else [token for delta in first for token in delta.token_ids] + rest
        return reply, context, tokens, hits, await settled(holder), await settled(other)

    reply, context, tokens, hits, holder_state, other_state = asyncio.run(run())
    reference = hf_greedy(tiny_llama_dir, [first_turn, context], 12)
    assert reply == reference[0].token_ids and tokens == reference[1].token_ids
    assert hits >= (len(first_turn) + len(reply) - 1) // 16 * 16  # the history's full blocks, not computed again
    assert holder_state == ({}, holder.engine.num_blocks) and other_state == ({}, other.engine.num_blocks)
    holder.engine.check_integrity()
    other.engine.check_integrity()
