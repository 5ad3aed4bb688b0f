"""#40 on a real cluster: a colocated pool of two replicas sends each conversation's next turn to
the replica that computed its history (its prefix cache holds it), not to the emptier one."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.integration.client import complete, duet_status, greedy_body, random_prompt, settled, wait_for

pytestmark = pytest.mark.slow

SESSIONS = 6
HISTORY_BLOCKS = 6  # a first turn's prompt, in blocks of 16


def _stats(url: str) -> list[dict]:
    return duet_status(url)["pools"]["colocated"]["stats"]


def test_a_colocated_pool_sends_a_conversations_next_turn_where_its_history_is(cluster, deploy):
    """Six sessions' first turns, one at a time, spread over two colocated replicas (by load and
    room, ties at random: printed); once the replicas report the prompts they hold, every
    session's second turn (its history, the reply, a new message) finds its whole first prompt
    in the prefix cache of the replica it is sent to: the pool's prefix-cache hits grow by at
    least every session's history. Without prefix routing (tried once) the second turns went by
    room and load, and found 192 of the 576 history tokens cached."""
    url = deploy("prefix-routing", {
        "mode": "colocated", "engine": {"max_model_len": 1024, "num_kv_blocks": 2048, "max_num_seqs": 16},
        "decode": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}},
        "router": {"ray_actor_options": {"num_cpus": 0}},
    })
    wait_for(lambda: len(_stats(url)) == 2, 60, "both replicas reporting")
    rng = random.Random(40)
    first_turns = [random_prompt(rng, 16 * HISTORY_BLOCKS) for _ in range(SESSIONS)]

    async def turns(prompts: list[list[int]]) -> list[list[int]]:
        replies = []
        async with httpx.AsyncClient(timeout=120) as client:
            for prompt in prompts:  # one at a time: each replica idle when the next arrives
                status, tokens, errors = await complete(client, url, greedy_body(prompt, 8))
                assert (status, errors) == (200, [])
                replies.append(tokens)
        return replies

    replies = asyncio.run(turns(first_turns))
    # The depths 1-4 of each session's chain: 4 routing hashes a 6-block prompt (block_pool.routing_depth).
    wait_for(lambda: sum(stats["prefix_hashes"] for stats in _stats(url)) >= 4 * SESSIONS, 30, "every first turn reported")
    print(f"\nfirst turns held per replica: {[stats['prefix_hashes'] // 4 for stats in _stats(url)]}")
    hits_before = sum(stats["prefix_cache_hits"] for stats in _stats(url))
    second_turns = [prompt + reply + random_prompt(rng, 20) for prompt, reply in zip(first_turns, replies)]
    asyncio.run(turns(second_turns))
    histories = SESSIONS * 16 * HISTORY_BLOCKS
    deadline = time.monotonic() + 20  # the replicas' reports come every second or so (bounded wait)
    while (hits := sum(stats["prefix_cache_hits"] for stats in _stats(url)) - hits_before) < histories and time.monotonic() < deadline:
        time.sleep(0.5)
    assert hits >= histories, f"{hits} prompt tokens found cached of the {SESSIONS} sessions' histories ({histories})"
    assert settled(cluster, url)["ok"]
