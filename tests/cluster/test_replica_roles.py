"""Replicas that change role, driven without Serve (``replica_pair``): a prefill replica that
takes the decode role and goes home under live streams, sheds and moves sequences by KV; a
colocated replica keeps its role; every replica builds its grammar tokenizer before it serves."""

from __future__ import annotations

import asyncio

import pytest

from duet.cluster.replica import EngineReplica
from duet.config import EngineArgs
from duet.decode_node.role import DecodeRole
from duet.engine import LLMEngine
from duet.messages import EngineRequest, ReplicaStats
from duet.prefill_node.role import PrefillRole
from duet.sampling_params import SamplingParams
from tests.cluster.replica_pair import DirectPeers, attached, placed, read_stream, settled


@pytest.fixture
def home_pair(tiny_llama_dir):
    """A PD pair as an application has it: a prefill replica and a decode replica, each able to
    serve the other's role (``take_role``), the prefill one moving sequences to the decode one."""
    made = []
    for name, role in (("p", PrefillRole()), ("d", DecodeRole())):
        engine = LLMEngine(
            EngineArgs(model=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512, kv_transfer_config={"name": name, "timeout_s": 20.0})
        )
        made.append(EngineReplica(name, role, engine, DirectPeers()))
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
            name: (await read_stream(await placed(decode, EngineRequest(f"undisturbed-{name}", prompt, params))))[0]
            for name, params in (("greedy", greedy), ("seeded", seeded))
        }
        with pytest.raises(ReplicaFullError, match="serves the prefill role"):
            await prefill.reserve(EngineRequest("early", prompt, greedy))
        assert await prefill.take_role("decode", "p") == "decode"
        streams = {name: await placed(prefill, EngineRequest(name, prompt, params)) for name, params in (("greedy", greedy), ("seeded", seeded))}
        read = {name: await read_until(stream, name, prefill, 6) for name, stream in streams.items()}
        assert await prefill.take_role("prefill", "p", hold_s=60.0) == "decode"  # held
        assert await prefill.take_role("prefill", "p") == "prefill"
        with pytest.raises(ReplicaFullError):
            await prefill.reserve(EngineRequest("late", prompt, greedy))
        # Through PD: the decode replica reserves, the prefill replica (its own streams running) computes.
        placement = await decode.reserve(EngineRequest("pd", prompt, greedy, kv_receive=True))
        first = [delta async for delta in prefill.generate(EngineRequest("pd", prompt, greedy, kv_send=placement.destination))]
        pd_stream = attached(decode, "pd", "d")
        pd_tokens = [token for delta in first for token in delta.token_ids] + await read_until(pd_stream, "pd", decode, 8)
        assert await decode.take_role("prefill", "d") == "prefill"
        with pytest.raises(ReplicaFullError):
            await decode.reserve(EngineRequest("refused", prompt, greedy))
        pd_tokens += (await read_stream(pd_stream))[0]
        for name, stream in streams.items():
            read[name] += (await read_stream(stream))[0]
        report = ReplicaStats.from_dict(await prefill.record_routing_stats())
        return undisturbed, read, pd_tokens, report, await settled(prefill), await settled(decode)

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
    replica = EngineReplica("c", DecodeRole(colocated=True), engine, DirectPeers())
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
    replica = EngineReplica("c", DecodeRole(colocated=True), engine, DirectPeers())
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
            (await read_stream(await placed(decode, EngineRequest(f"alone-{index}", prompt, param))))[0]
            for index, (prompt, param) in enumerate(zip(prompts, params))
        ]
        assert await prefill.take_role("decode", "p") == "decode"
        streams = [await placed(decode, EngineRequest(f"s{index}", prompt, param)) for index, (prompt, param) in enumerate(zip(prompts, params))]
        read = [list((await anext(stream)).token_ids) for stream in streams]
        shed = await decode.shed("prefill", "p", 3, "d")
        again = await decode.shed("prefill", "p", 3, "d")  # those left: the short one, and two
        moves = {}
        for index, stream in enumerate(streams):
            token_ids, moved = await read_stream(stream)
            read[index] += token_ids
            if moved is not None:
                moves[index] = (moved.replica_id, moved.pool)
                read[index] += (await read_stream(attached(prefill, f"s{index}", "p")))[0]
        return undisturbed, shed, again, read, moves, await settled(prefill), await settled(decode)

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
        undisturbed = {name: (await read_stream(await placed(decode, EngineRequest(f"alone-{name}", prompt, p))))[0] for name, p in params.items()}
        assert await prefill.take_role("decode", "p") == "decode"
        streams = {name: await placed(prefill, EngineRequest(name, prompt, p)) for name, p in params.items()}
        read = {name: list((await anext(stream)).token_ids) for name, stream in streams.items()}
        departed = asyncio.Event()
        departed.set()
        leaving = asyncio.create_task(prefill._leave_when_departed(departed))
        moves = {}
        for name, stream in streams.items():
            token_ids, moved = await read_stream(stream)
            await stream.aclose()  # the router closes a stream that told it of a move
            read[name] += token_ids
            moves[name] = None if moved is None else moved.replica_id
            read[name] += (await read_stream(attached(decode, name, "d")))[0]
        await asyncio.wait_for(leaving, 10)
        with pytest.raises(ReplicaFullError, match="leaving its pool"):
            await prefill.reserve(EngineRequest("late", prompt, params["greedy"]))
        return undisturbed, read, moves, await settled(prefill), await settled(decode)

    undisturbed, read, moves, prefill_state, decode_state = asyncio.run(run())
    assert moves == {"greedy": "d", "seeded": "d"}
    assert read == undisturbed
    assert prefill_state == ({}, prefill.engine.num_blocks) and decode_state == ({}, decode.engine.num_blocks)
    for replica in home_pair:
        replica.engine.check_integrity()
