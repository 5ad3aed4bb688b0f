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

from duet.cluster.replica import EngineReplica
from duet.config import EngineArgs
from duet.decode_node.role import DecodeRole
from duet.engine import LLMEngine
from duet.messages import EngineRequest, Moved, Placement, ReplicaStats
from duet.prefill_node.role import PrefillRole
from duet.sampling_params import SamplingParams


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


class _DirectPeers:
    """``decode_node.migration.Peers`` of one replica of a pair: the other, called in this process."""

    def __init__(self) -> None:
        self.other: EngineReplica | None = None

    async def reserve(self, request: EngineRequest, num_prompt_blocks: int, to=None) -> Placement:
        assert to is None or to.replica_id == self.other.replica_id
        return await self.other.reserve(request, num_prompt_blocks)

    def abort(self, request_id: str, replica_id: str, pool: str | None = None) -> None:
        asyncio.ensure_future(self.other.abort(request_id, replica_id))

    def any_running(self) -> bool:
        return True


def _decode_pair(tiny_llama_dir, **engine_kwargs):
    """Two decode replicas that can move sequences to one another by KV, over a real pair."""
    made = []

    def make(name: str, peers: _DirectPeers) -> EngineReplica:
        engine = LLMEngine(
            EngineArgs(
                model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512, kv_transfer_config={"name": name, "timeout_s": 20.0},
                **engine_kwargs,
            )
        )
        made.append(EngineReplica(name, DecodeRole(), engine, peers))
        return made[-1]

    leaving_peers, staying_peers = _DirectPeers(), _DirectPeers()
    leaving, staying = make("leaving", leaving_peers), make("staying", staying_peers)
    leaving_peers.other, staying_peers.other = staying, leaving
    yield leaving, staying
    for replica in made:
        for task in replica._tasks:
            task.cancel()
        replica.loop.stop()
        replica.engine.close()


@pytest.fixture
def decode_pair(tiny_llama_dir):
    yield from _decode_pair(tiny_llama_dir)


@pytest.fixture
def speculating_pair(tiny_llama_dir):
    """The pair, drafting with a draft model (the tiny Llama itself: its drafts are mostly kept)."""
    config = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3, "adaptive": False}
    yield from _decode_pair(tiny_llama_dir, speculative_config=config)


async def _settled(replica: EngineReplica, within_s: float = 20.0) -> tuple[dict, int]:
    """The replica's sequences and free blocks once it holds none (or as they are at the deadline)."""
    engine = replica.engine
    deadline = time.monotonic() + within_s
    while True:
        state = await replica.loop.call(lambda: (dict(engine.scheduler.requests), engine.kv_cache_manager.num_free_blocks))
        if state == ({}, engine.num_blocks) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.05)


def test_a_stream_closed_while_its_sequence_moves_by_kv_frees_it_on_the_new_replica(decode_pair):
    """Guards the leak a review found: a sequence moved by KV off a leaving replica, its client
    gone before the router read where it went; the abort reached the old replica alone, and the
    new one decoded it on, into a queue nobody read, its blocks taken until the attach timed out."""
    leaving, staying = decode_pair
    params = SamplingParams(temperature=0.0, max_tokens=400, min_tokens=400)

    async def run():
        stream = await _placed(leaving, EngineRequest("moving", list(range(100, 140)), params))
        while leaving.engine.scheduler.requests["moving"].num_output_tokens < 5:
            await anext(stream)
        leaving.draining = True
        await leaving.migration.move("moving", by_kv=True)
        assert "moving" in staying.migration.adopted
        await stream.aclose()  # the client left before reading the move
        return await _settled(staying), await _settled(leaving), dict(staying.migration.adopted)

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


async def _placed(replica: EngineReplica, request: EngineRequest):
    """A sequence placed on a replica as the router places one (``reserve``), and its stream (``attach``)."""
    placement = await replica.reserve(request)
    assert placement.replica_id == replica.replica_id
    return replica.attach(request.request_id, replica.replica_id)


async def _read(stream) -> tuple[list[int], Moved | None]:
    """A replica's stream read to its end: the tokens it streamed, and the move that ended it, if one did."""
    token_ids = []
    async for item in stream:
        if isinstance(item, Moved):
            return token_ids, item
        token_ids += item.token_ids
    return token_ids, None


def test_a_seeded_sequence_moved_by_kv_while_speculating_goes_on_as_if_it_had_stayed(speculating_pair):
    """Guards a seeded stream across a move (#12): speculation drew its random numbers per step,
    not per token, so the new replica, advancing a fresh generator one draw per token so far,
    went on with another stream than the one it would have had."""
    leaving, staying = speculating_pair
    prompt, params = list(range(100, 140)), SamplingParams(temperature=0.8, max_tokens=48, min_tokens=48, seed=5)

    async def run():
        undisturbed, _ = await _read(await _placed(staying, EngineRequest("undisturbed", prompt, params)))
        stream = await _placed(leaving, EngineRequest("moving", prompt, params))
        while leaving.engine.scheduler.requests["moving"].num_output_tokens < 9:
            await anext(stream)
        leaving.draining = True
        await leaving.migration.move("moving", by_kv=True)
        before, moved = await _read(stream)
        after, _ = await _read(staying.attach("moving", "staying"))
        return undisturbed, moved, after

    undisturbed, moved, after = asyncio.run(run())
    assert moved is not None and moved.replica_id == "staying" and len(moved.token_ids) >= 9
    assert moved.token_ids + after == undisturbed
    stats = staying.engine.stats()
    assert stats.spec.num_accepted_tokens > 0, stats
    staying.engine.check_integrity()


@pytest.fixture
def home_pair(tiny_llama_dir):
    """A PD pair as an application has it: a prefill replica and a decode replica, each able to
    serve the other's role (``take_role``), the prefill one moving sequences to the decode one."""
    made = []
    for name, role in (("p", PrefillRole()), ("d", DecodeRole())):
        engine = LLMEngine(
            EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512, kv_transfer_config={"name": name, "timeout_s": 20.0})
        )
        made.append(EngineReplica(name, role, engine, _DirectPeers()))
    made[0].migration.peers.other, made[1].migration.peers.other = made[1], made[0]
    yield made
    for replica in made:
        for task in replica._tasks:
            task.cancel()
        replica.loop.stop()
        replica.engine.close()


def test_a_role_change_under_live_streams_loses_and_duplicates_no_token(home_pair):
    """#38: a prefill replica takes the decode role and streams sequences; it goes back to
    prefill with them still running and computes a prompt for the decode replica, which serves
    prefill in turn with that sequence running: every stream, greedy and seeded, reads on as if
    no role had changed, each role's calls are refused (to be tried elsewhere) while the other
    is served, a role taken is held ``hold_s``, and every block is accounted for after."""
    from duet.errors import ReplicaFullError

    prefill, decode = home_pair
    prompt = list(range(100, 150))
    greedy = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
    seeded = SamplingParams(temperature=0.8, max_tokens=40, min_tokens=40, seed=5)

    async def read_until(stream, request_id: str, replica: EngineReplica, tokens: int) -> list[int]:
        token_ids = []
        while replica.engine.scheduler.requests[request_id].num_output_tokens < tokens:
            token_ids += (await anext(stream)).token_ids
        return token_ids

    async def run():
        undisturbed = {
            name: (await _read(await _placed(decode, EngineRequest(f"undisturbed-{name}", prompt, params))))[0]
            for name, params in (("greedy", greedy), ("seeded", seeded))
        }
        with pytest.raises(ReplicaFullError, match="serves the prefill role"):
            await prefill.reserve(EngineRequest("early", prompt, greedy))
        assert await prefill.take_role("decode", "p") == "decode"
        streams = {name: await _placed(prefill, EngineRequest(name, prompt, params)) for name, params in (("greedy", greedy), ("seeded", seeded))}
        read = {name: await read_until(stream, name, prefill, 6) for name, stream in streams.items()}
        assert await prefill.take_role("prefill", "p", hold_s=60.0) == "decode"  # held
        assert await prefill.take_role("prefill", "p") == "prefill"
        with pytest.raises(ReplicaFullError):
            await prefill.reserve(EngineRequest("late", prompt, greedy))
        # Through PD: the decode replica reserves, the prefill replica (its own streams running) computes.
        placement = await decode.reserve(EngineRequest("pd", prompt, greedy, kv_receive=True))
        first = [delta async for delta in prefill.generate(EngineRequest("pd", prompt, greedy, kv_send=placement.destination))]
        pd_stream = decode.attach("pd", "d")
        pd_tokens = [token for delta in first for token in delta.token_ids] + await read_until(pd_stream, "pd", decode, 8)
        assert await decode.take_role("prefill", "d") == "prefill"
        with pytest.raises(ReplicaFullError):
            await decode.reserve(EngineRequest("refused", prompt, greedy))
        pd_tokens += (await _read(pd_stream))[0]
        for name, stream in streams.items():
            read[name] += (await _read(stream))[0]
        report = ReplicaStats.from_dict(await prefill.record_routing_stats())
        return undisturbed, read, pd_tokens, report, await _settled(prefill), await _settled(decode)

    undisturbed, read, pd_tokens, report, prefill_state, decode_state = asyncio.run(run())
    assert read == undisturbed
    assert pd_tokens == undisturbed["greedy"]
    assert (report.stage, report.replica_id) == ("prefill", "p")
    assert prefill_state == ({}, prefill.engine.num_blocks) and decode_state == ({}, decode.engine.num_blocks)
    for replica in home_pair:
        replica.engine.check_integrity()


def test_a_colocated_replica_keeps_its_role(tiny_llama_dir):
    from duet.errors import InvalidRequestError

    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=16))
    replica = EngineReplica("c", DecodeRole(colocated=True), engine, _DirectPeers())
    try:
        with pytest.raises(InvalidRequestError, match="serves only the colocated role"):
            asyncio.run(replica.take_role("prefill", "c"))
    finally:
        replica.loop.stop()
        engine.close()


def test_a_replica_builds_the_grammar_tokenizer_before_it_serves_and_its_runner_asks_for_the_same(tiny_llama_dir):
    """llguidance's tokenizer build holds the GIL (~0.25 s, seconds beside other replicas): built at
    a first constrained request, it froze every stream of the replica and its reports. A replica
    builds it first, under the key its runner's masks use, so no request builds it again."""
    from duet.structured_output import _grammar_tokenizer

    _grammar_tokenizer.cache_clear()
    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=16))
    assert _grammar_tokenizer.cache_info().currsize == 0
    replica = EngineReplica("c", DecodeRole(colocated=True), engine, _DirectPeers())
    try:
        assert _grammar_tokenizer.cache_info().currsize == 1
        assert engine.executor.worker.runner.grammar.tokenizer() is engine.grammar_tokenizer()
        assert _grammar_tokenizer.cache_info().currsize == 1
    finally:
        replica.loop.stop()
        engine.close()


def test_a_busy_decode_replica_sheds_sequences_by_kv_to_one_that_took_the_role(home_pair):
    """#38: the prefill replica takes the decode role while the decode replica runs six streams;
    the decode replica sheds half of its share to it, by KV, the ones with the most to make first
    and each once at most: each shed stream ends with ``Moved`` naming the replica and its pool,
    reads on there with the tokens it would have had (greedy and seeded), and every block is
    accounted for after."""
    prefill, decode = home_pair
    params = [SamplingParams(temperature=0.0, max_tokens=60 + 4 * index, min_tokens=60 + 4 * index) for index in range(3)]
    params += [SamplingParams(temperature=0.8, max_tokens=60 + 4 * index, min_tokens=60 + 4 * index, seed=index) for index in range(3, 5)]
    params.append(SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20))  # too little left to be worth a move
    prompts = [list(range(100 + index, 140 + index)) for index in range(len(params))]

    async def run():
        undisturbed = [
            (await _read(await _placed(decode, EngineRequest(f"alone-{index}", prompt, param))))[0]
            for index, (prompt, param) in enumerate(zip(prompts, params))
        ]
        assert await prefill.take_role("decode", "p") == "decode"
        streams = [await _placed(decode, EngineRequest(f"s{index}", prompt, param)) for index, (prompt, param) in enumerate(zip(prompts, params))]
        read = [list((await anext(stream)).token_ids) for stream in streams]
        shed = await decode.shed("prefill", "p", 3, "d")
        again = await decode.shed("prefill", "p", 3, "d")  # those left: the short one, and two
        moves = {}
        for index, stream in enumerate(streams):
            token_ids, moved = await _read(stream)
            read[index] += token_ids
            if moved is not None:
                moves[index] = (moved.replica_id, moved.pool)
                read[index] += (await _read(prefill.attach(f"s{index}", "p")))[0]
        return undisturbed, shed, again, read, moves, await _settled(prefill), await _settled(decode)

    undisturbed, shed, again, read, moves, prefill_state, decode_state = asyncio.run(run())
    assert read == undisturbed
    assert shed == 3 and set(moves) >= {4, 3, 2}  # the most to make first
    assert 5 not in moves and all(where == ("p", "prefill") for where in moves.values())
    assert again <= 2 and len(moves) == shed + again
    assert prefill_state == ({}, prefill.engine.num_blocks) and decode_state == ({}, decode.engine.num_blocks)
    for replica in home_pair:
        replica.engine.check_integrity()


def test_a_prefill_replica_serving_decode_moves_its_streams_when_it_leaves_its_pool(home_pair):
    """#38: Serve stops a prefill replica (a scale-down, a replacement) while it serves decode:
    its streams move by KV to the decode pool, end here with ``Moved``, and read on there with
    the tokens they would have had (greedy and seeded); it refuses new sequences meanwhile, and
    every block is accounted for after."""
    from duet.errors import ReplicaFullError

    prefill, decode = home_pair
    prompt = list(range(100, 150))
    params = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40),
        "seeded": SamplingParams(temperature=0.8, max_tokens=40, min_tokens=40, seed=3),
    }

    async def run():
        undisturbed = {name: (await _read(await _placed(decode, EngineRequest(f"alone-{name}", prompt, p))))[0] for name, p in params.items()}
        assert await prefill.take_role("decode", "p") == "decode"
        streams = {name: await _placed(prefill, EngineRequest(name, prompt, p)) for name, p in params.items()}
        read = {name: list((await anext(stream)).token_ids) for name, stream in streams.items()}
        departed = asyncio.Event()
        departed.set()
        leaving = asyncio.create_task(prefill._leave_when_departed(departed))
        moves = {}
        for name, stream in streams.items():
            token_ids, moved = await _read(stream)
            await stream.aclose()  # the router closes a stream that told it of a move
            read[name] += token_ids
            moves[name] = None if moved is None else moved.replica_id
            read[name] += (await _read(decode.attach(name, "d")))[0]
        await asyncio.wait_for(leaving, 10)
        with pytest.raises(ReplicaFullError, match="leaving its pool"):
            await prefill.reserve(EngineRequest("late", prompt, params["greedy"]))
        return undisturbed, read, moves, await _settled(prefill), await _settled(decode)

    undisturbed, read, moves, prefill_state, decode_state = asyncio.run(run())
    assert moves == {"greedy": "d", "seeded": "d"}
    assert read == undisturbed
    assert prefill_state == ({}, prefill.engine.num_blocks) and decode_state == ({}, decode.engine.num_blocks)
    for replica in home_pair:
        replica.engine.check_integrity()


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
