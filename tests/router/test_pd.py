"""The orchestrator's decode streams, against a pool handle that answers in this process: every
sequence is placed by ``reserve`` and streamed through its replica's channel (``attach_to``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import duet.router.decode_stream as decode_stream
import duet.router.pd as pd
from duet.errors import KVTransferFailedError
from duet.messages import EngineRequest, Moved, Placement, TokenDelta
from duet.sampling_params import SamplingParams
from tests.router.channel_end import ChannelEnd


class _SilentCall:
    """A Serve call that never answers (Serve lists no replica: it waits in the queue)."""

    def __init__(self) -> None:
        self.cancelled = False

    def __await__(self):
        return asyncio.Event().wait().__await__()

    def cancel(self) -> None:
        self.cancelled = True


class _SilentPool:
    def __init__(self) -> None:
        self.calls: list[_SilentCall] = []
        self.kwargs: list[dict] = []
        self.reserve = self

    def remote(self, *args, **kwargs) -> _SilentCall:
        self.calls.append(_SilentCall())
        self.kwargs.append(kwargs)
        return self.calls[-1]



def test_a_placement_no_replica_answers_fails_in_bounded_time(monkeypatch):
    """Guards the clients of a pool whose last replica died: Serve, listing none, queues the call
    without limit, and the request hung (its admission held) until a replica came back, if ever."""
    monkeypatch.setattr(decode_stream, "PLACE_WAIT_S", 0.2)
    pool = _SilentPool()
    orchestrator = pd.Orchestrator(None, pool, 16, None)
    fired = []
    orchestrator.fire = lambda pool_name, replica_id, call: fired.append(replica_id)
    request = EngineRequest("waiting", [1, 2, 3], SamplingParams(max_tokens=4))

    async def run():
        stream = decode_stream.DecodeStream(orchestrator, request)
        with pytest.raises(pd.PoolUnavailableError, match="no decode replica took this request"):
            await asyncio.wait_for(stream.place(), 5)
        await stream.aclose()

    asyncio.run(run())
    assert len(pool.calls) == 1 and pool.calls[0].cancelled
    assert fired == []  # it ran nowhere: nothing to abort


def test_a_context_computed_where_it_is_placed_names_its_prefix_to_the_pools_router(monkeypatch):
    """A sequence whose context the decode (or colocated) replica computes itself asks its
    pool's router for the replica holding that context's prefix (``prefix_hashes``); one whose
    KV comes from a prefill replica names none (routed by room alone)."""
    from duet.block_pool import routing_block_hashes

    monkeypatch.setattr(decode_stream, "PLACE_WAIT_S", 0.1)
    prompt = list(range(100, 150))
    hashes = routing_block_hashes(prompt, 16)
    assert len(hashes) == 3  # its three full blocks
    for kv_receive, expected in ((False, hashes), (True, None)):
        pool = _SilentPool()
        orchestrator = pd.Orchestrator(None, pool, 16, None)
        orchestrator.fire = lambda *args: None
        request = EngineRequest("placed", prompt, SamplingParams(max_tokens=4), kv_receive=kv_receive)

        async def run():
            stream = decode_stream.DecodeStream(orchestrator, request, num_prompt_blocks=4)
            with pytest.raises(pd.PoolUnavailableError):
                await asyncio.wait_for(stream.place(), 5)
            await stream.aclose()

        asyncio.run(run())
        assert pool.kwargs[0]["prefix_hashes"] == expected and pool.kwargs[0]["num_prompt_blocks"] == 4


class _ScriptedPool:
    """A decode pool whose ``reserve`` calls answer the placements given (an exception is raised)
    and whose ``attach_to`` calls play the scripts given, in order."""

    def __init__(self, placements: list, attaches: list) -> None:
        self.placements, self.attaches, self.calls = list(placements), list(attaches), []
        self.reserve = _Method(self._reserve)
        end = ChannelEnd(self._play)
        self.channel, self.attach_to = end.channel, end.attach_to
        self.abort = _Method(lambda *args, **kwargs: asyncio.sleep(0))

    def options(self, stream: bool):
        return self

    async def _reserve(self, request, **_):
        self.calls.append(("reserve", request))
        placement = self.placements.pop(0)
        if isinstance(placement, Exception):
            raise placement
        return placement

    async def _play(self, request_id: str, replica_id: str):
        self.calls.append(("attach", request_id))
        for item in self.attaches.pop(0):
            yield item


class _Method:
    def __init__(self, call) -> None:
        self.remote = call


def test_a_moved_sequence_whose_kv_is_lost_is_recomputed_whatever_the_failure_policy():
    """Guards a stream failed mid-way under ``on_transfer_failure: fail``: that policy is for a
    prompt's own KV, and a move whose KV did not arrive was documented (and meant) to recompute."""
    params = SamplingParams(temperature=0.0, max_tokens=3)
    pool = _ScriptedPool(
        placements=[Placement("x"), Placement("z")],
        attaches=[
            [TokenDelta("s", [11]), TokenDelta("s", [12]), Moved("y", [11, 12])],
            [KVTransferFailedError("the KV of s did not arrive")],
            [TokenDelta("s.1", [13], finished=True, finish_reason="length")],
        ],
    )
    orchestrator = pd.Orchestrator(None, pool, 16, None, on_transfer_failure="fail")

    async def run():
        return [delta.token_ids async for delta in orchestrator.run("s", [1, 2, 3], params)]

    assert asyncio.run(run()) == [[11], [12], [13]]
    kinds = [kind for kind, _ in pool.calls]
    assert kinds == ["reserve", "attach", "attach", "reserve", "attach"]
    assert pool.calls[2][1] == "s"  # attached where it moved, then started over with its tokens so far:
    resumed = pool.calls[3][1]
    assert (resumed.request_id, resumed.output_token_ids) == ("s.1", [11, 12])
    assert orchestrator.migrations == {"kv": 1, "recompute": 1}


def test_a_prompts_lost_kv_fails_under_the_fail_policy():
    params = SamplingParams(temperature=0.0, max_tokens=3)
    pool = _ScriptedPool(placements=[Placement("x")], attaches=[[KVTransferFailedError("the prompt's KV did not arrive")]])
    orchestrator = pd.Orchestrator(None, pool, 16, None, on_transfer_failure="fail")

    async def run():
        return [delta async for delta in orchestrator.run("s", [1, 2, 3], params)]

    with pytest.raises(KVTransferFailedError):
        asyncio.run(run())


def test_a_full_replica_sends_the_reservation_to_another_and_the_sequence_streams_from_there():
    from duet.errors import ReplicaFullError

    params = SamplingParams(temperature=0.0, max_tokens=2)
    pool = _ScriptedPool(
        placements=[ReplicaFullError("full"), Placement("y")],
        attaches=[[TokenDelta("s", [5]), TokenDelta("s", [6], finished=True, finish_reason="length")]],
    )
    orchestrator = pd.Orchestrator(None, pool, 16, None)

    async def run():
        return [delta.token_ids async for delta in orchestrator.run("s", [1, 2, 3], params)]

    assert asyncio.run(run()) == [[5], [6]]
    assert [kind for kind, _ in pool.calls] == ["reserve", "reserve", "attach"]
    assert orchestrator.migrations == {"kv": 0, "recompute": 0}


def test_a_context_sent_where_its_history_is_reserves_there_first_and_its_end_is_recorded(monkeypatch):
    """A local choice naming the replica this router saw end the context's history
    (``Choice.holder``) reserves there first, pinned; that replica full or dead (then forgotten),
    the pool's router places it at once. A sequence that ends is recorded where it ran: its context but the last token, whose KV
    no step computed (``duet.router.held``); a colocated pool's next turn is reserved there first."""
    from duet.block_pool import routing_block_hashes
    from duet.errors import ReplicaFullError
    from duet.router.balance import Choice
    from duet.router.held import Holder

    class Pool(_ScriptedPool):
        async def _reserve(self, request, **kwargs):
            self.pins.append(kwargs.get("replica_id"))
            return await super()._reserve(request)

    from ray.exceptions import RayActorError

    slept, sleep = [], asyncio.sleep
    monkeypatch.setattr(decode_stream.asyncio, "sleep", lambda delay, *args: (delay and slept.append(delay)) or sleep(0, *args))
    cases = (
        ([Placement("h")], ["h"]), ([ReplicaFullError("full"), Placement("y")], ["h", None]), ([RayActorError(), Placement("y")], ["h", None]),
    )
    for placements, pins in cases:
        pool = Pool(placements, attaches=[[TokenDelta("s", [5]), TokenDelta("s", [6, 7], finished=True, finish_reason="length")]])
        pool.pins = []
        orchestrator = pd.Orchestrator(None, pool, 16, None)
        orchestrator.held.add("h", "colocated", list(range(40)))
        request = EngineRequest("s", list(range(40)), SamplingParams(max_tokens=3))

        async def run():
            stream = decode_stream.DecodeStream(orchestrator, request, choice=Choice(True, 8, holder=Holder("h", "colocated", 2)))
            placement = await stream.place()
            tokens = [delta.token_ids async for delta in stream]
            await stream.aclose()
            return placement.replica_id, tokens

        slept.clear()
        assert asyncio.run(run()) == (pins[-1] or "y", [[5], [6, 7]]) and pool.pins == pins
        assert slept == []  # a holder that cannot take it is passed over at once, no backing off
        died = isinstance(placements[0], RayActorError)  # the replica holding the history died: forgotten
        assert (orchestrator.held.holder(routing_block_hashes(list(range(40)), 16)) is None) == died

    ends = [TokenDelta("s", [5]), TokenDelta("s", [6, 7], finished=True, finish_reason="length")]
    pool = Pool([Placement("y"), Placement("y")], [ends, [TokenDelta("t", [9], finished=True, finish_reason="length")]])
    pool.pins = []
    orchestrator = pd.Orchestrator(None, pool, 16, None)  # colocated: the record still counts

    async def run(request_id, prompt):
        return [delta.token_ids async for delta in orchestrator.run(request_id, prompt, SamplingParams(max_tokens=3))]

    assert asyncio.run(run("s", list(range(45)))) == [[5], [6, 7]]
    next_turn = list(range(45)) + [5, 6, 7, 8]  # 49 tokens: 3 full blocks, the KV of 2 held
    assert orchestrator.held.holder(routing_block_hashes(next_turn, 16)) == Holder("y", "colocated", 2)
    assert asyncio.run(run("t", next_turn)) == [[9]] and pool.pins == [None, "y"]  # the next turn reserved there first


def test_a_history_held_by_a_busy_replica_is_placed_by_the_pools_router(monkeypatch):
    """The pin to where a history ended keeps the pools' routers' rule: the holder takes the
    context while its load passes the least loaded decode replica's by ``IMBALANCE_THRESHOLD`` at
    most, its load the larger of its report and the sequences this router has open there or is
    placing there (a burst outruns the reports and the placements); busier, or not listed any
    more, the pool's router places it."""
    from duet.router import serve_internals
    from duet.router.balance import Choice
    from duet.router.held import Holder
    from duet.router.routing import IMBALANCE_THRESHOLD
    from tests.router.fake_serve import FakePool

    listed = FakePool("colocated")
    monkeypatch.setitem(serve_internals._ROUTERS, "colocated", listed)
    orchestrator = pd.Orchestrator(None, None, 16, None)
    holder = Holder("h", "colocated", 2)
    assert orchestrator.targets.holder(holder) == ("colocated", "h")  # nothing listed yet: pinned
    listed.set("h", num_running=IMBALANCE_THRESHOLD + 1, num_waiting=1)
    listed.set("y", num_running=2)
    assert orchestrator.targets.holder(holder) == ("colocated", "h")  # 6 against 2
    listed.set("h", num_running=IMBALANCE_THRESHOLD + 2, num_waiting=1)
    assert orchestrator.targets.holder(holder) is None  # 7 against 2
    listed.set("h", num_running=0)
    for index in range(IMBALANCE_THRESHOLD + 3):  # each stream counts itself open on the orchestrator
        decode_stream.DecodeStream(orchestrator, EngineRequest(f"open-{index}", [1], SamplingParams()), replica_id="h")
    assert orchestrator.targets.holder(holder) is None  # reported idle, but 7 open there against 2
    orchestrator.open_streams.clear()
    assert orchestrator.targets.holder(holder) == ("colocated", "h")
    for index in range(IMBALANCE_THRESHOLD + 3):  # a burst: reserved there first, none placed yet
        decode_stream.DecodeStream(
            orchestrator, EngineRequest(f"burst-{index}", [1], SamplingParams()), choice=Choice(True, 1, holder=holder)
        )
    assert orchestrator.targets.holder(holder) is None  # 7 headed there against 2
    orchestrator.open_streams.clear()
    listed.remove("h")
    assert orchestrator.targets.holder(holder) is None  # gone

    # Roles that move: the replicas serving decode, in either pool, are compared; a holder
    # serving prefill now takes no reservation.
    from duet.router.roles import RoleView
    from tests.router.fake_serve import make_stats

    members = {
        "decode": [("h", make_stats("decode", "h", num_running=7)), ("y", make_stats("prefill", "y"))],
        "prefill": [("p", make_stats("decode", "p", num_running=2))],
    }
    orchestrator = pd.Orchestrator(object(), None, 16, None, roles=RoleView(lambda pool: members.get(pool, [])))
    decode_holder = Holder("h", "decode", 2)
    assert orchestrator.targets.holder(decode_holder) is None  # 7 against the away replica's 2
    members["prefill"] = [("p", make_stats("decode", "p", num_running=3))]
    assert orchestrator.targets.holder(decode_holder) == ("decode", "h")
    members["decode"][0] = ("h", make_stats("prefill", "h"))
    assert orchestrator.targets.holder(decode_holder) is None

    class Pool(_ScriptedPool):
        async def _reserve(self, request, **kwargs):
            self.pins.append(kwargs.get("replica_id"))
            return await super()._reserve(request)

    # Through the orchestrator (colocated): the busy holder is passed by, the idle one pinned.
    listed.set("h", num_running=IMBALANCE_THRESHOLD + 3)
    done = [TokenDelta("s", [5], finished=True, finish_reason="length")]
    pool = Pool([Placement("y"), Placement("h")], attaches=[done, done])
    pool.pins = []
    orchestrator = pd.Orchestrator(None, pool, 16, None)
    orchestrator.held.add("h", "colocated", list(range(40)))

    async def run():
        return [delta.token_ids async for delta in orchestrator.run("s", list(range(40)), SamplingParams(max_tokens=1))]

    assert asyncio.run(run()) == [[5]] and pool.pins == [None]
    listed.set("h", num_running=0)
    orchestrator.held.add("h", "colocated", list(range(40)))  # (the first run's end was recorded on y)
    assert asyncio.run(run()) == [[5]] and pool.pins == [None, "h"]


def test_a_turn_whose_history_holder_is_busy_is_sent_from_it_to_another_decode_replica(monkeypatch):
    """#40, PD: the balancer chose to compute a turn where its history is, on a replica too busy
    (``Targets.holder``) to decode it too: another decode replica reserves its KV (the holder
    avoided), and the holder, pinned, sends its history's 4 blocks and one token more (a pull:
    ``generate(from_history=True)`` on the context's first 65 tokens, its token dropped); the
    receiver computes the rest, samples the first token and decodes. With prompt logprobs (which
    a pull would not compute) the holder computes the whole turn past its history and sends it,
    its first token the turn's. Placed on the holder after all (the one replica with room), it
    is computed there."""
    from duet.router import serve_internals
    from duet.router.balance import Choice
    from duet.router.held import Holder
    from tests.router.fake_serve import FakePool

    listed = FakePool("decode")
    monkeypatch.setitem(serve_internals._ROUTERS, "decode", listed)
    listed.set("h", num_running=9)
    listed.set("y", num_running=1)

    class Pool(_ScriptedPool):
        def __init__(self, placements, attaches, firsts):
            super().__init__(placements, attaches)
            self.generate = _Method(self._generate)
            self.firsts, self.kwargs, self.own_prompt_lens = firsts, [], []

        async def _reserve(self, request, **kwargs):
            self.kwargs.append(
                ("reserve", request.kv_receive, kwargs.get("avoid"), kwargs.get("replica_id"), request.kv_receive_tokens)
            )
            return await super()._reserve(request)

        def _generate(self, request, **kwargs):
            self.kwargs.append(
                ("generate", request.request_id, kwargs.get("from_history"), kwargs.get("replica_id"), len(request.prompt_token_ids))
            )
            self.own_prompt_lens.append(request.own_prompt_len)

            async def deltas():
                yield self.firsts.pop(0)

            return _Streamed(deltas())

    def orchestrator_for(pool):
        orchestrator = pd.Orchestrator(object(), pool, 16, None)
        settles = SimpleNamespace(_done=lambda choice, first_token: pool.calls.append(("settled", first_token)))
        choice = lambda *args: Choice(True, 8, balancer=settles, holder=Holder("h", "decode", 4))  # noqa: E731
        orchestrator.waiting_room = SimpleNamespace(choose=_async(choice))
        return orchestrator

    pool = Pool([Placement("y")], [[TokenDelta("s", [5, 6, 7], finished=True, finish_reason="length")]], [TokenDelta("s", [9])])
    orchestrator = orchestrator_for(pool)

    async def run(orchestrator, **params):
        params = SamplingParams(max_tokens=3, **params)
        return [delta.token_ids async for delta in orchestrator.run("s", list(range(80)), params)]

    assert asyncio.run(run(orchestrator)) == [[5, 6, 7]]
    placed = pool.calls[0][1].request_id
    assert pool.kwargs == [("reserve", True, "h", None, 65), ("generate", placed, True, "h", 65)]  # into y's reservation
    assert pool.own_prompt_lens == [80]  # its RoPE the whole prompt's, where that depends on the length
    assert (orchestrator.history_sends, orchestrator.history_pulls, orchestrator.prefill_fallbacks) == (1, 1, 0)
    # The balancer learns when the first token came: from the receiver, for a pull.
    assert [call[0] for call in pool.calls] == ["reserve", "attach", "settled"] and pool.calls[-1] == ("settled", True)

    pool = Pool([Placement("y")], [[TokenDelta("s", [6, 7], finished=True, finish_reason="length")]], [TokenDelta("s", [5])])
    orchestrator = orchestrator_for(pool)
    assert asyncio.run(run(orchestrator, prompt_logprobs=1)) == [[5], [6, 7]]
    placed = pool.calls[0][1].request_id
    assert pool.kwargs == [("reserve", True, "h", None, None), ("generate", placed, True, "h", 80)]
    assert (orchestrator.history_sends, orchestrator.history_pulls) == (1, 0)
    assert [call[0] for call in pool.calls] == ["reserve", "settled", "attach"] and pool.calls[1] == ("settled", True)

    pool = Pool([Placement("h"), Placement("h")], [[TokenDelta("s", [5, 6, 7], finished=True, finish_reason="length")]], [])
    orchestrator = orchestrator_for(pool)
    assert asyncio.run(run(orchestrator)) == [[5, 6, 7]]
    assert [call[:2] for call in pool.kwargs] == [("reserve", True), ("reserve", False)]  # computed there
    assert orchestrator.history_sends == 0


class _Streamed:
    """A Serve streaming call's response: iterated, and cancelled once read."""

    def __init__(self, deltas) -> None:
        self.deltas = deltas

    def __aiter__(self):
        return self.deltas

    def cancel(self) -> None:
        pass


def _async(function):
    async def call(*args, **kwargs):
        return function(*args, **kwargs)

    return call
