"""The pools' request routers rank replicas by prefix affinity, load and free KV blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from duet.block_pool import routing_block_hashes
from duet.router.routing import ADAPTER_LOAD_CREDIT, adapter_loads, choose, prefix_first, rank_by_capacity, rank_by_prefix
from tests.router.fake_serve import make_stats


def _replica(name: str, **stats) -> SimpleNamespace:
    return SimpleNamespace(replica_id=name, routing_stats=make_stats("x", name, **stats).to_dict())


def test_prefill_prefers_the_replica_holding_the_longest_leading_prefix():
    prompt = list(range(100))
    hashes = routing_block_hashes(prompt, 16)
    cold, warm, partial = _replica("cold"), _replica("warm", prefix_hashes=hashes), _replica("partial", prefix_hashes=hashes[:1])
    ranks = rank_by_prefix([cold, partial, warm], {"cold": 0, "warm": 0, "partial": 0}, hashes, len(prompt), imbalance_threshold=4)
    assert ranks[0] == [warm]


def test_prefill_falls_back_to_the_least_loaded_when_the_warm_replica_is_swamped():
    hashes = routing_block_hashes(list(range(64)), 16)
    cold, warm = _replica("cold"), _replica("warm", prefix_hashes=hashes)
    assert rank_by_prefix([warm, cold], {"cold": 0, "warm": 9}, hashes, 64, imbalance_threshold=4)[0] == [cold]


def test_prefill_weighs_a_held_prefix_against_the_prompt_tokens_queued_on_its_holder():
    """Guards the pool whose one replica took nearly every prompt: a chat template's system
    prompt (two blocks) held by one prefill replica drew every prompt there while its queue
    stayed within the request margin (1.9 times the pool's mean queue of prompt tokens over a
    multi-turn run, of two replicas). Now a replica's cost is the prompt tokens queued there
    (its report's, or its prompts in flight at this one's size) plus this prompt's past what it
    holds; costs within ``NEAR_COST`` of the lowest go to the least loaded, at random among equals."""
    system = list(range(5000, 5032))  # two blocks every prompt shares
    prompt = system + list(range(100, 400))
    hashes = routing_block_hashes(prompt, 16)
    held = routing_block_hashes(system, 16)
    holder, other = _replica("holder", prefix_hashes=held), _replica("other")
    idle = {"holder": 0, "other": 0}
    firsts = {rank_by_prefix([holder, other], idle, hashes, len(prompt), 4)[0][0].replica_id for _ in range(40)}
    assert firsts == {"holder", "other"}  # 300 tokens to compute against 332: near enough, either
    history = _replica("holder", prefix_hashes=routing_block_hashes(prompt[:320], 16), prompt_tokens_pending=200)
    assert rank_by_prefix([other, history], idle, hashes, len(prompt), 4)[0] == [history]  # 320 held outweigh 200 queued
    busy = _replica("holder", prefix_hashes=routing_block_hashes(prompt[:320], 16), prompt_tokens_pending=500)
    assert rank_by_prefix([busy, other], idle, hashes, len(prompt), 4)[0] == [other]  # 512 against 332
    in_flight = {"holder": 2, "other": 0}  # two prompts since its report: 664 queued at this one's size
    assert rank_by_prefix([history, other], in_flight, hashes, len(prompt), 4)[0] == [other]
    both = [_replica("a", prefix_hashes=held), _replica("b", prefix_hashes=held)]
    assert rank_by_prefix(both, {"a": 1, "b": 0}, hashes, len(prompt), 4)[0][0].replica_id == "b"  # equals: the least loaded


def test_routing_hashes_name_a_long_prompt_at_a_few_depths_of_its_chain():
    """Guards the router that matched a prompt's first four blocks only: conversations sharing
    a system prompt of four blocks or more all looked alike, and a session's later turn went to
    any replica rather than the one holding its history."""
    from duet.block_pool import hash_block_tokens, routing_depth

    assert [depth for depth in range(1, 300) if routing_depth(depth)] == [1, 2, 3, 4, *range(8, 257, 4)]
    prompt = list(range(3000))
    chain, parent = [], None
    for index in range(len(prompt) // 16):
        parent = hash_block_tokens(parent, prompt[index * 16 : (index + 1) * 16])
        chain.append(parent)
    assert routing_block_hashes(prompt, 16) == [chain[depth - 1] for depth in (1, 2, 3, 4, *range(8, 188, 4))]
    system = list(range(5000, 5000 + 16 * 40))  # a 40-block system prompt every session shares
    session_a, session_b = system + list(range(100, 600)), system + list(range(700, 1200))
    holder_a = _replica("a", prefix_hashes=routing_block_hashes(session_a, 16))
    holder_b = _replica("b", prefix_hashes=routing_block_hashes(session_b, 16))
    next_turn_b = session_b + list(range(2000, 2100))
    ranks = rank_by_prefix([holder_a, holder_b], {"a": 0, "b": 0}, routing_block_hashes(next_turn_b, 16), len(next_turn_b), imbalance_threshold=4)
    assert ranks[0] == [holder_b]


def test_decode_prefers_room_for_the_prompt_then_fewer_running_then_more_free_blocks():
    full = _replica("full", num_free_blocks=2)
    busy = _replica("busy", num_free_blocks=90)
    idle_small = _replica("idle-small", num_free_blocks=20)
    idle_big = _replica("idle-big", num_free_blocks=80)
    ranks = rank_by_capacity([full, busy, idle_small, idle_big], {"full": 0, "busy": 5, "idle-small": 1, "idle-big": 1}, 10)
    assert [rank[0].replica_id for rank in ranks] == ["idle-big", "idle-small", "busy", "full"]


def test_a_context_computed_on_a_decode_or_colocated_replica_goes_where_its_history_is():
    """A colocated request (or a prompt prefilled on a decode replica) goes first to the replica
    with room holding the longest run of its leading blocks, not to the emptiest: a conversation's
    next turn then starts from its history's KV. Not where that replica lacks room for the
    prompt, nor where it is busier than the least loaded by more than the threshold."""
    system = list(range(5000, 5000 + 16 * 8))
    session = system + list(range(100, 400))
    next_turn = routing_block_hashes(session + list(range(900, 964)), 16)
    holder = _replica("holder", num_free_blocks=50, prefix_hashes=routing_block_hashes(session, 16))
    shares_system = _replica("system", num_free_blocks=70, prefix_hashes=routing_block_hashes(system + [1] * 32, 16))
    idle = _replica("idle", num_free_blocks=90)

    def first(loads, blocks=10, hashes=next_turn):
        ranks = prefix_first(rank_by_capacity([idle, shares_system, holder], loads, blocks), loads, hashes, 4, blocks)
        assert sorted(rank[0].replica_id for rank in ranks) == ["holder", "idle", "system"]
        return ranks[0][0].replica_id

    assert first({"holder": 2, "system": 0, "idle": 0}) == "holder"
    assert first({"holder": 2, "system": 0, "idle": 0}, hashes=[]) == "idle"  # KV received: by room and load alone
    assert first({"holder": 2, "system": 0, "idle": 0}, blocks=60) == "system"  # no room on the holder: the next best match
    assert first({"holder": 5, "system": 0, "idle": 0}) == "idle"  # the holder busier by more than 4: by room and load


def test_a_replica_holding_the_calls_adapter_is_preferred_unless_busier_by_more_than_the_credit():
    holder, other = _replica("holder", num_free_blocks=50, held=["sql"]), _replica("other", num_free_blocks=90)
    for busier, expected in ((ADAPTER_LOAD_CREDIT - 1, "holder"), (ADAPTER_LOAD_CREDIT + 1, "other")):
        loads = adapter_loads([holder, other], {"holder": busier, "other": 0}, "sql")
        assert rank_by_capacity([holder, other], loads, 10)[0][0].replica_id == expected
        assert rank_by_prefix([holder, other], loads, [], 100, imbalance_threshold=4)[0][0].replica_id == expected
    assert adapter_loads([holder, other], {"holder": 1, "other": 0}, None) == {"holder": 1, "other": 0}
    assert adapter_loads([holder, other], {"holder": 1, "other": 0}, "chat") == {"holder": 1, "other": 0}


def test_a_call_pinned_to_a_gone_replica_goes_to_a_live_one_and_every_round_backs_off():
    """Guards the router that never recovered after a decode replica died: for a clean-up call
    pinned to the dead replica ``choose_replicas`` chose nothing and never asked Serve to back
    off, so Serve retried at once, forever, in a coroutine that never awaited: the routing loop
    spun and starved every other call (503 for everyone, /health timing out). Now the call goes
    to a live replica, which refuses it at once (``ReplicaGoneError``), and every round backs off."""
    from ray.serve._private.request_router.common import RequestRoutingContext

    def pinned(replica_id: str) -> SimpleNamespace:
        return SimpleNamespace(kwargs={"replica_id": replica_id}, routing_context=RequestRoutingContext())

    live = _replica("live")
    live.replica_id = SimpleNamespace(unique_id="live")
    gone, here = pinned("dead"), pinned("live")
    unranked = []
    assert choose([live], gone, lambda candidates, kwargs: unranked.append(candidates)) == [[live]]
    assert choose([live], here, lambda candidates, kwargs: unranked.append(candidates)) == [[live]]
    assert unranked == [] and gone.routing_context.should_backoff and here.routing_context.should_backoff


def test_a_reservation_avoids_the_replica_sending_its_kv_while_another_is_left():
    """A context sent from the decode replica holding its history (``avoid``) is reserved on
    another replica of the pool; with that one alone left, on it (it is then computed there)."""
    from ray.serve._private.request_router.common import RequestRoutingContext

    replicas = []
    for name in ("holder", "other"):
        replicas.append(_replica(name))
        replicas[-1].replica_id = SimpleNamespace(unique_id=name)
    ranked = []
    request = SimpleNamespace(kwargs={"avoid": "holder"}, routing_context=RequestRoutingContext())
    choose(replicas, request, lambda candidates, kwargs: ranked.append(candidates))
    choose(replicas[:1], request, lambda candidates, kwargs: ranked.append(candidates))
    assert [[replica.replica_id.unique_id for replica in candidates] for candidates in ranked] == [["other"], ["holder"]]


def test_a_replica_refuses_a_call_pinned_to_another():
    from duet.errors import ReplicaGoneError

    ReplicaGoneError.check("abc", "abc")
    with pytest.raises(ReplicaGoneError, match="replica dead is gone"):
        ReplicaGoneError.check("dead", "abc")


def test_an_adapters_routing_hashes_are_its_own_and_the_same_in_every_process():
    """Guards prefix affinity for LoRA requests: the router and the replicas hash a prompt in
    different processes (each with its own string hash seed), and an adapter's KV is not the
    base's, so its chain starts elsewhere."""
    import os
    import subprocess
    import sys

    prompt = list(range(64))
    code = "from duet.block_pool import routing_block_hashes; print(routing_block_hashes(list(range(64)), 16, 'sql'))"
    seen = {
        subprocess.run([sys.executable, "-c", code], env=os.environ | {"PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True).stdout
        for seed in ("1", "2")
    }
    assert seen == {f"{routing_block_hashes(prompt, 16, 'sql')}\n"}
    base, sql, chat = (set(routing_block_hashes(prompt, 16, lora)) for lora in (None, "sql", "chat"))
    assert not base & sql and not sql & chat
