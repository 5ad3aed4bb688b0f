"""The router's end of the channels (``duet.router.channels``), against replicas answered in this
process by the replica's own end (``duet.decode_node.channel``)."""

from __future__ import annotations

import asyncio

import pytest

import duet.router.channels as channels_module
from duet.errors import ReplicaGoneError
from duet.messages import TokenDelta
from tests.router.channel_end import ChannelEnd, StreamCall


class _Pool:
    def __init__(self, end) -> None:
        self.channel = end.channel
        self.attach_to = end.attach_to

    def options(self, stream: bool):
        return self


def test_one_channel_serves_every_sequence_on_a_replica_and_closes_once_none_follows_for_a_while(monkeypatch):
    monkeypatch.setattr(channels_module, "LINGER_S", 0.1)

    async def play(request_id, replica_id):
        for index in range(3):
            await asyncio.sleep(0.01)
            yield TokenDelta(request_id, [index], finished=index == 2)

    end = ChannelEnd(play)
    channels = channels_module.Channels({"decode": _Pool(end)}, lambda: None)

    async def read(request_id, replica_id="r1"):
        channel_id, queue = channels.follow("decode", replica_id, request_id)
        await end.attach_to.remote(request_id, replica_id=replica_id, channel_id=channel_id)
        items = [queue.get_nowait() for _ in range(queue.qsize())]
        channels.leave(replica_id, channel_id, request_id)
        return channel_id, [item.token_ids for item in items]

    async def run():
        first = await asyncio.gather(read("a"), read("b"), read("c", "r2"))
        open_after = dict(channels._open)
        await asyncio.sleep(0.3)  # past the linger: both closed
        closed = dict(channels._open)
        again = await read("d")
        return first, open_after, closed, again

    first, open_after, closed, again = asyncio.run(run())
    assert [tokens for _, tokens in first] == [[[0], [1], [2]]] * 3
    assert first[0][0] == first[1][0] != first[2][0]  # one channel a replica
    assert set(open_after) == {"r1", "r2"} and closed == {}
    assert again[0] not in {first[0][0], first[2][0]} and again[1] == [[0], [1], [2]]
    assert channels.opened == 3
    assert channels.items == 12 and 4 <= channels.messages <= 12  # a message holds one step's items or more


def test_a_channel_that_fails_tells_every_sequence_on_it_that_its_replica_is_gone():
    """Each then starts over elsewhere from its tokens so far, as when its replica died."""

    class _Failing:
        def __init__(self) -> None:
            self.channel = self
            self.started = asyncio.Event()

        def options(self, stream: bool):
            return self

        def remote(self, channel_id, replica_id):
            async def batches():
                yield [("a", TokenDelta("a", [5]))]
                self.started.set()
                raise RuntimeError("the stream broke")

            return StreamCall(batches())

    async def run():
        pool = _Failing()
        channels = channels_module.Channels({"decode": pool}, lambda: None)
        queues = [channels.follow("decode", "r1", name)[1] for name in ("a", "b")]
        await pool.started.wait()
        await asyncio.sleep(0.05)
        return [[queue.get_nowait() for _ in range(queue.qsize())] for queue in queues], dict(channels._open)

    (a_items, b_items), still_open = asyncio.run(run())
    assert a_items[0].token_ids == [5] and isinstance(a_items[1], ReplicaGoneError)
    assert len(b_items) == 1 and isinstance(b_items[0], ReplicaGoneError)
    assert "the stream broke" in str(b_items[0])
    assert still_open == {}  # the next sequence there opens a new one


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_sequence_read_through_its_channel_raises_its_replicas_error_after_its_tokens(where):
    """An error that ends a sequence (here its KV was lost) comes through the channel after the
    tokens before it, whichever way the replica's end was reached first."""
    from duet.errors import KVTransferFailedError
    from duet.router.decode_stream import DecodeStream

    async def play(request_id, replica_id):
        yield TokenDelta(request_id, [1])
        yield TokenDelta(request_id, [2])
        yield KVTransferFailedError("lost")

    end = ChannelEnd(play)

    class _Orchestrator:
        decode_pool = "decode"
        open_streams: set = set()
        handles = {"decode": _Pool(end)}
        channels = channels_module.Channels(handles, lambda: None)

        def fire(self, pool, replica_id, call):
            pass  # the abort of a sequence that failed: nothing to abort in this process

    async def run():
        from duet.messages import EngineRequest
        from duet.sampling_params import SamplingParams

        if where == "before":  # the channel's call already open when the sequence attaches
            _Orchestrator.channels.follow("decode", "r1", "warm")
        stream = DecodeStream(_Orchestrator(), EngineRequest("s", [1], SamplingParams()), replica_id="r1")
        seen = []
        with pytest.raises(KVTransferFailedError):
            async for item in stream:
                seen.append(item.token_ids)
        await stream.aclose()
        return seen

    assert asyncio.run(run()) == [[1], [2]]


def test_sequences_that_end_leave_their_channel_so_it_closes_and_their_replica_can_stop(monkeypatch):
    """Guards a replica held open: the orchestrator stops reading a sequence at its last item, and
    a reader that left the channel only when the sequence's generator was collected kept the
    channel's call open on the replica (Serve waited a minute to delete its application)."""
    import duet.router.pd as pd
    from duet.messages import Placement
    from duet.sampling_params import SamplingParams

    monkeypatch.setattr(channels_module, "LINGER_S", 0.05)

    async def play(request_id, replica_id):
        yield TokenDelta(request_id, [1])
        yield TokenDelta(request_id, [2], finished=True, finish_reason="length")

    end = ChannelEnd(play)

    class _Decode(_Pool):
        def __init__(self) -> None:
            super().__init__(end)

            async def reserve(request, **kwargs):
                return Placement("x")

            self.reserve = type("Remote", (), {"remote": staticmethod(reserve)})()

    orchestrator = pd.Orchestrator(None, _Decode(), 16, None)

    async def run():
        async def one(name):
            return [delta.token_ids async for delta in orchestrator.run(name, [1, 2, 3], SamplingParams(max_tokens=2))]

        tokens = await asyncio.gather(one("a"), one("b"))
        followers = {replica: dict(channel.followers) for replica, channel in orchestrator.channels._open.items()}
        await asyncio.sleep(0.3)
        return tokens, followers, dict(orchestrator.channels._open), len(end.hosts["x"])

    tokens, followers, still_open, replica_channels = asyncio.run(run())
    assert tokens == [[[1], [2]]] * 2
    assert followers == {"x": {}}  # both left as they ended
    assert still_open == {} and replica_channels == 0  # closed on both ends after the linger
