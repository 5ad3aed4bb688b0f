"""Roles that move with load (``duet.router.roles``): the plan from the replicas' reports, the
role view the router reads, the keeper that asks the replicas, and where the orchestrator then
sends each role's calls. Reports are made as replicas make them; no Serve."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import duet.router.decode_stream as decode_stream
import duet.router.pd as pd
from duet.messages import Placement, TokenDelta
from duet.router.roles import Member, RoleKeeper, RoleSettings, RoleView, plan
from duet.sampling_params import SamplingParams
from tests.router.channel_end import ChannelEnd
from tests.router.fake_serve import make_stats

TTFT_S, TPOT_S = 2.0, 0.2
SETTINGS = RoleSettings(move=True, lend_idle=False, min_prefill=0, min_decode=1, hold_s=5.0)  # the config's defaults


def member(pool: str, replica_id: str, role: str | None = None, **stats) -> Member:
    role = role or pool
    return Member(pool, replica_id, role, make_stats(role, replica_id, **stats))


def _idle_prefill(replica_id: str = "p", role: str | None = None) -> Member:
    return member("prefill", replica_id, role, prefill_tokens_per_s=1000.0)


def test_no_decode_replica_left_a_prefill_replica_takes_the_role_at_once():
    changes = plan([_idle_prefill("p1"), member("prefill", "p2", num_running=3, prompt_tokens_pending=500)], SETTINGS, TTFT_S, TPOT_S)
    assert [(change.replica_id, change.role, change.urgent) for change in changes] == [("p1", "decode", True)]


def test_decode_short_while_prefill_idles_takes_the_prefill_replica():
    slow = member("decode", "d", num_running=8, tpot_s=0.35, prefill_tokens_per_s=1000.0)
    assert [(change.replica_id, change.role, change.reason) for change in plan([_idle_prefill(), slow], SETTINGS, TTFT_S, TPOT_S)] == [
        ("p", "decode", "decode_tpot")
    ]
    waiting = member("decode", "d", num_running=8, num_decode_waiting=2)
    assert [change.reason for change in plan([_idle_prefill(), waiting], SETTINGS, TTFT_S, TPOT_S)] == ["decode_waiting"]


def test_a_busy_prefill_pool_or_its_minimum_keeps_its_replica():
    slow = member("decode", "d", num_running=8, tpot_s=0.35)
    busy = member("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=800)
    assert plan([busy, slow], SETTINGS, TTFT_S, TPOT_S) == []
    assert plan([_idle_prefill(), slow], dataclasses.replace(SETTINGS, min_prefill=1), TTFT_S, TPOT_S) == []
    assert plan([_idle_prefill(), slow], dataclasses.replace(SETTINGS, move=False), TTFT_S, TPOT_S) == []


def test_prefill_short_while_a_decode_replica_idles_takes_it_and_the_last_decode_replica_stays():
    queued = member("prefill", "p", prefill_tokens_per_s=1000.0, prompt_tokens_pending=6000)
    idle, decoding = member("decode", "d1"), member("decode", "d2", num_running=2, num_free_blocks=90, tpot_s=0.05)
    changes = plan([queued, idle, decoding], SETTINGS, TTFT_S, TPOT_S)
    assert [(change.replica_id, change.role, change.reason) for change in changes] == [("d1", "prefill", "prefill_prompt_backlog")]
    assert plan([queued, decoding], SETTINGS, TTFT_S, TPOT_S) == []  # min_decode: 1


def test_a_replica_away_goes_back_first_and_comes_home_when_its_role_can_spare_it():
    away = member("prefill", "p", role="decode", num_running=1, tpot_s=0.05)
    home = member("decode", "d", num_running=1, tpot_s=0.05)
    assert plan([away, home], SETTINGS, TTFT_S, TPOT_S) == []  # both decode: decode cannot spare one
    home = member("decode", "d")
    assert [(change.replica_id, change.role, change.reason) for change in plan([away, home], SETTINGS, TTFT_S, TPOT_S)] == [
        ("p", "prefill", "home")
    ]
    # Prefill short, decode spare: the replica away goes back rather than a decode replica leaving.
    queued = member("decode", "d", num_running=0, prefill_tokens_per_s=1000.0, new_prompt_tokens_pending=6000)
    idle_away = member("prefill", "p", role="decode", prefill_tokens_per_s=1000.0)
    changes = plan([idle_away, queued], SETTINGS, TTFT_S, TPOT_S)
    assert [(change.replica_id, change.role) for change in changes] == [("p", "prefill")]
    # ... even with sequences of its own, which it finishes in its home role.
    busy_away = member("prefill", "p", role="decode", num_running=3, prefill_tokens_per_s=1000.0)
    busy_home = member("decode", "d", num_running=3, prefill_tokens_per_s=1000.0, new_prompt_tokens_pending=6000)
    assert [(change.replica_id, change.role) for change in plan([busy_away, busy_home], SETTINGS, TTFT_S, TPOT_S)] == [("p", "prefill")]


def test_an_idle_prefill_replica_serves_decode_while_decode_is_busy_and_load_evens_out():
    from duet.router.roles import shed_plan

    lend = dataclasses.replace(SETTINGS, lend_idle=True)
    busy = member("decode", "d", num_running=6, tpot_s=0.15)
    changes = plan([_idle_prefill(), busy], lend, TTFT_S, TPOT_S)
    assert [(change.replica_id, change.role, change.reason) for change in changes] == [("p", "decode", "prefill_idle")]
    assert plan([_idle_prefill(), busy], SETTINGS, TTFT_S, TPOT_S) == []  # not lent by default
    assert plan([_idle_prefill(), member("decode", "d", num_running=6, tpot_s=0.08)], lend, TTFT_S, TPOT_S) == []  # well in time
    assert plan([member("prefill", "p", num_running=1, prompt_tokens_pending=100), busy], lend, TTFT_S, TPOT_S) == []
    assert plan([_idle_prefill(), member("decode", "d", num_running=1)], lend, TTFT_S, TPOT_S) == []
    away = member("prefill", "p", role="decode")
    busiest, least, count = shed_plan([away, busy])
    assert (busiest.replica_id, least.replica_id, count) == ("d", "p", 3)
    assert shed_plan([member("prefill", "p", role="decode", num_running=4), busy]) is None
    assert shed_plan([member("decode", "d2"), busy]) is None  # the decode pool's own: evened out where placed


def test_decoding_sequences_left_on_a_replica_serving_prefill_move_to_the_least_busy_decoder():
    """#38: a decode replica that took the prefill role (or a prefill replica gone home) still
    decodes what it held: those sequences move by KV to the least busy replica serving decode,
    before any evening out, so its core goes to prompts; with none serving decode they stay."""
    from duet.router.roles import shed_plan

    took_prefill = member("decode", "d1", role="prefill", num_running=5, num_decoding_blocks=40)
    busy, idle = member("decode", "d2", num_running=6), member("prefill", "p", role="decode", num_running=1)
    busiest, least, count = shed_plan([took_prefill, busy, idle])
    assert (busiest.replica_id, least.replica_id, count) == ("d1", "p", 5)
    gone_home = member("prefill", "p2", num_running=2, num_decoding_blocks=8)
    assert [m.replica_id for m in shed_plan([gone_home, busy])[:2]] == ["p2", "d2"]
    assert shed_plan([member("decode", "d1", role="prefill", num_running=5, num_decoding_blocks=0), busy]) is None  # prompts alone
    assert shed_plan([took_prefill]) is None


class _Pools:
    """Both pools' running replicas and reports, as ``serve_internals.pool_members`` gives them."""

    def __init__(self, **pools: list) -> None:
        self.pools = pools

    def members(self, pool: str) -> list:
        return [(stats.replica_id, stats) for stats in self.pools.get(pool, [])]


class _TakeRole:
    def __init__(self, replica_roles: dict) -> None:
        self.roles = replica_roles
        self.calls = []

    async def _take(self, role: str, replica_id: str, hold_s: float) -> str:
        self.calls.append((role, replica_id, hold_s))
        self.roles[replica_id] = role
        return role

    @property
    def take_role(self):
        return _Remote(self._take)


class _Remote:
    def __init__(self, call) -> None:
        self.remote = call


def test_the_keeper_asks_the_replica_and_counts_its_role_until_its_report_tells_it():
    pools = _Pools(prefill=[make_stats("prefill", "p", prefill_tokens_per_s=1000.0, reported_at=time.time() - 1)], decode=[])
    view = RoleView(pools.members, lambda pool: len(pools.pools.get(pool, [])))
    prefill_pool = _TakeRole({})
    keeper = RoleKeeper(view, {"prefill": prefill_pool, "decode": _TakeRole({})}, SETTINGS, TTFT_S, TPOT_S, lambda: None)
    taken = asyncio.run(keeper.tick())
    assert [(change.replica_id, change.role) for change in taken] == [("p", "decode")]
    assert prefill_pool.calls == [("decode", "p", 0.0)]  # urgent: no hold
    assert [(m.replica_id, m.role, m.away) for m in view.members()] == [("p", "decode", True)]
    assert view.size("decode") == 1 and view.size("prefill") == 0
    assert asyncio.run(keeper.tick()) == []  # the role given counts: nothing more to do
    assert keeper.changes == {"no_decode_replica": 1}


def test_a_pool_not_seen_yet_has_no_size_rather_than_zero():
    view = RoleView(lambda pool: [], lambda pool: None)
    assert view.size("prefill") is None and view.stats("prefill") == []


class _Pool:
    """A pool handle whose ``reserve`` and ``attach_to`` record their keywords and answer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = []
        self.reserve = _Remote(self._reserve)
        end = ChannelEnd(self._attach)
        self.channel, self.attach_to = end.channel, end.attach_to
        self.abort = _Remote(lambda *args, **kwargs: asyncio.sleep(0))

    def options(self, stream: bool):
        return self

    async def _reserve(self, request, **kwargs):
        self.calls.append(("reserve", kwargs.get("replica_id")))
        return Placement(kwargs.get("replica_id") or f"{self.name}-ranked")

    def _attach(self, request_id: str, replica_id: str):
        self.calls.append(("attach", replica_id))

        async def items():
            yield TokenDelta(request_id, [9], finished=True, finish_reason="length")

        return items()


def test_a_sequence_goes_to_a_prefill_replica_serving_decode_when_it_is_the_least_loaded():
    away = make_stats("decode", "p")
    home_busy = make_stats("decode", "d", num_running=3)
    pools = _Pools(prefill=[away], decode=[home_busy])
    view = RoleView(pools.members, lambda pool: 1)
    prefill, decode = _Pool("prefill"), _Pool("decode")
    orchestrator = pd.Orchestrator(prefill, decode, 16, None, roles=view)
    assert orchestrator.targets.decode() == ("prefill", "p")
    request = pd.EngineRequest("s", [1, 2, 3], SamplingParams(max_tokens=1))

    async def run():
        stream = decode_stream.DecodeStream(orchestrator, request)
        placement = await stream.place()
        items = [item async for item in stream]
        return placement, items, stream.pool

    placement, items, pool = asyncio.run(run())
    assert (placement.replica_id, pool, [item.token_ids for item in items]) == ("p", "prefill", [[9]])
    assert prefill.calls == [("reserve", "p"), ("attach", "p")] and decode.calls == []
    # A home replica as little loaded: the decode pool's own router ranks.
    pools.pools["decode"] = [make_stats("decode", "d")]
    assert orchestrator.targets.decode() == ("decode", None)
    # Nobody serves decode, a prefill replica could: wait for the keeper; nobody at all: the pool.
    pools.pools = {"prefill": [make_stats("prefill", "p")], "decode": []}
    assert orchestrator.targets.decode() == (None, None)
    pools.pools = {}
    assert orchestrator.targets.decode() == ("decode", None)


def test_a_context_goes_to_a_decode_replica_serving_prefill_with_less_queued():
    pools = _Pools(prefill=[make_stats("prefill", "p", prompt_tokens_pending=900)], decode=[make_stats("prefill", "d")])
    orchestrator = pd.Orchestrator(_Pool("prefill"), _Pool("decode"), 16, None, roles=RoleView(pools.members, lambda pool: 1))
    assert orchestrator.targets.prefill() == ("decode", "d")
    pools.pools["prefill"] = [make_stats("prefill", "p")]
    assert orchestrator.targets.prefill() == ("prefill", None)


def test_a_pools_router_passes_by_a_replica_serving_the_other_role_unless_none_is_left():
    from types import SimpleNamespace

    from duet.router.routing import choose

    def replica(name: str, stage: str) -> SimpleNamespace:
        return SimpleNamespace(replica_id=name, routing_stats=make_stats(stage, name).to_dict())

    home, away = replica("d1", "decode"), replica("d2", "prefill")
    ranked = []

    def rank(candidates, kwargs):
        ranked.append([candidate.replica_id for candidate in candidates])
        return [candidates]

    choose([home, away], None, rank, "decode")
    choose([away], None, rank, "decode")  # the role nobody else serves: tried all the same
    assert ranked == [["d1"], ["d2"]]


def test_a_sequence_shed_to_a_replica_of_the_prefill_pool_is_read_on_there():
    from duet.messages import Moved

    class _Shedding(_Pool):
        def _attach(self, request_id: str, replica_id: str):
            self.calls.append(("attach", replica_id))

            async def items():
                yield TokenDelta(request_id, [7])
                yield Moved("p", [7], "prefill")

            return items()

    from duet.router.balance import StageBalancer

    pools = _Pools(prefill=[make_stats("prefill", "p")], decode=[make_stats("decode", "d")])
    prefill, decode = _Pool("prefill"), _Shedding("decode")
    local = StageBalancer(lambda pool: None, lambda pool: 0, 0, TTFT_S, TPOT_S)  # no prefill replica: every context local
    orchestrator = pd.Orchestrator(prefill, decode, 16, local, roles=RoleView(pools.members, lambda pool: 1))

    async def run():
        return [delta.token_ids async for delta in orchestrator.run("s", [1, 2, 3], SamplingParams(max_tokens=2))]

    assert asyncio.run(run()) == [[7], [9]]
    assert decode.calls == [("reserve", None), ("attach", "decode-ranked")] and prefill.calls == [("attach", "p")]
    assert orchestrator.migrations == {"kv": 1, "recompute": 0}
