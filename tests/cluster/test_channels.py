"""A replica's channels (``duet.decode_node.channel``) on a real engine of the tiny Llama, driven
without Serve: the sequences a router follows come a step a message, each in its own order."""

from __future__ import annotations

import asyncio
import time

from duet.messages import EngineRequest
from duet.sampling_params import SamplingParams
from tests.cluster.replica_pair import placed, read_stream, settled

PROMPTS = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(3)]


async def _place_together(replica, requests):
    """Reserve ``requests`` while the engine thread is busy, so that they join the same step."""
    replica.loop.call_soon(time.sleep, 0.3)
    await asyncio.gather(*(replica.reserve(request) for request in requests))


def test_the_sequences_a_router_follows_come_a_step_a_message_with_the_tokens_each_streams_alone(decode_pair):
    replica, _ = decode_pair
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def run():
        alone = [(await read_stream(await placed(replica, EngineRequest(f"alone{i}", prompt, params))))[0] for i, prompt in enumerate(PROMPTS)]
        reader = replica.channel("router-1", replica.replica_id)
        await _place_together(replica, [EngineRequest(f"s{i}", prompt, params) for i, prompt in enumerate(PROMPTS)])
        feeds = [asyncio.ensure_future(replica.attach_to(f"s{i}", replica.replica_id, "router-1")) for i in range(len(PROMPTS))]
        tokens, finished, batches = {f"s{i}": [] for i in range(len(PROMPTS))}, set(), []
        async for batch in reader:
            batches.append([request_id for request_id, _ in batch])
            for request_id, item in batch:
                assert request_id not in finished  # nothing after a sequence's last item
                tokens[request_id] += item.token_ids
                if item.finished:
                    finished.add(request_id)
            if len(finished) == len(PROMPTS):
                break
        await reader.aclose()
        await asyncio.gather(*feeds)
        return alone, tokens, batches, await settled(replica), len(replica.channels)

    alone, tokens, batches, state, channels_left = asyncio.run(run())
    assert [tokens[f"s{i}"] for i in range(len(PROMPTS))] == alone
    assert all(len(tokens) == 12 for tokens in alone)
    # One message a step: placed together, the three run in the same twelve steps, and each
    # step's three items come in one batch (the engine loop hands a step over in one callback),
    # never split; a reader slower than the engine (a loaded machine) gets two steps in one.
    assert all(batch == ["s0", "s1", "s2"] * (len(batch) // 3) and batch for batch in batches), batches
    assert sum(len(batch) for batch in batches) == 3 * 12
    assert state == ({}, replica.engine.num_blocks)
    assert channels_left == 0  # nobody reads it and nobody feeds it: dropped


def test_a_sequence_whose_router_stops_following_it_is_aborted_and_the_others_go_on(decode_pair):
    """Cancelling ``attach_to`` (its client left) aborts the sequence and frees its blocks, as
    closing its own stream did; the channel goes on for the rest."""
    replica, _ = decode_pair
    short = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def run():
        reader = replica.channel("router-2", replica.replica_id)
        await _place_together(replica, [EngineRequest("leaves", PROMPTS[0], long), EngineRequest("stays", PROMPTS[1], short)])
        leaving = asyncio.ensure_future(replica.attach_to("leaves", replica.replica_id, "router-2"))
        staying = asyncio.ensure_future(replica.attach_to("stays", replica.replica_id, "router-2"))
        seen = {"leaves": 0, "stays": 0}
        async for batch in reader:
            for request_id, item in batch:
                seen[request_id] += len(item.token_ids)
                if request_id == "leaves" and seen["leaves"] >= 3 and not leaving.done():
                    leaving.cancel()
            if seen["stays"] >= 16:
                break
        await reader.aclose()
        await staying
        return seen, leaving.cancelled(), await settled(replica)

    seen, cancelled, state = asyncio.run(run())
    assert cancelled and 3 <= seen["leaves"] < 400 and seen["stays"] == 16
    assert state == ({}, replica.engine.num_blocks)
    replica.engine.check_integrity()


def test_items_of_sequences_that_ended_before_their_channel_was_read_wait_for_it(monkeypatch):
    """Guards lost tokens: short sequences fed a channel and ended before the router's ``channel``
    call reached the replica (Serve assigns the calls independently), and the channel, unread and
    unfollowed, was dropped with their items; a burst with cancellations left such requests
    waiting for ever. A channel nobody ever comes for is dropped after ``UNREAD_S``."""
    import duet.decode_node.channel as channel_module
    from duet.messages import TokenDelta

    async def items(name):
        yield TokenDelta(name, [1])
        yield TokenDelta(name, [2], finished=True)

    async def run():
        channels = channel_module.Channels()
        await channels.feed("late", "a", items("a"))
        await channels.feed("late", "b", items("b"))
        kept = len(channels)
        reader = channels.serve("late")
        batch = await anext(reader)
        await reader.aclose()
        await channels.feed("never", "c", items("c"))
        monkeypatch.setattr(channel_module, "UNREAD_S", 0.0)
        await channels.feed("other", "d", items("d"))  # its call sweeps the one nobody read
        return kept, [(request_id, item.token_ids) for request_id, item in batch], len(channels)

    kept, batch, left = asyncio.run(run())
    assert kept == 1
    assert batch == [("a", [1]), ("a", [2]), ("b", [1]), ("b", [2])]
    assert left == 1  # "other", unread, waits for its reader; "late" read and "never" swept
