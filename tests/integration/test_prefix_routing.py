"""#40 on a real cluster: a colocated pool of two replicas sends each conversation's next turn to
the replica that computed its history (its prefix cache holds it), not to the emptier one."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.integration.client import complete, duet_status, greedy_body, metric, random_prompt, settled, wait_for

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


PD_APP = {
    "mode": "pd",
    "engine": {"max_model_len": 1024, "num_kv_blocks": 2048, "max_num_seqs": 16},
    "prefill": {"ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}},
    "decode": {
        "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1}, "local_prefill_threshold": 64, "engine": {"num_threads": 1},
    },
    "router": {"ray_actor_options": {"num_cpus": 0}},
}
PD_FIRST_TURN, PD_REPLY, PD_MESSAGE = 160, 40, 20  # a first turn and its reply: 12 full blocks of KV on decode
# Prompt steps of 16 tokens, which never measure a prompt speed (``duet.load``: 32 tokens at least).
PD_UNMEASURED_APP = PD_APP | {"engine": PD_APP["engine"] | {"max_num_batched_tokens": 16}}


def test_a_pd_conversations_next_turn_is_computed_where_its_reply_was_decoded(cluster, tiny_offline, deploy):
    """Four sessions' first turns, one at a time, through the prefill pool (160 tokens, past the
    threshold); the decode replica each went to holds its prompt (received) and the reply it
    decoded, 12 blocks, where the prefill replica holds the prompt's 10. Each second turn (that
    history and a new message) is computed on the decode replica holding the history, not sent
    through the prefill pool, which would compute the reply again: a local prefill each (the
    router's count), the history's 192 tokens found cached, and the offline engine's tokens.
    With the history held on decode not counted (tried once), the second turns went through the
    prefill pool and found 160 tokens cached each there (the first prompt; not the reply)."""
    url = deploy("pd-history", PD_APP)
    wait_for(lambda: len(duet_status(url)["pools"]["decode"]["stats"]) == 2, 60, "both decode replicas reporting")
    rng = random.Random(41)
    first_turns = [random_prompt(rng, PD_FIRST_TURN) for _ in range(SESSIONS - 2)]

    async def turns(prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], int]]:
        answers = []
        async with httpx.AsyncClient(timeout=120) as client:
            for prompt in prompts:  # one at a time
                response = await client.post(f"{url}/v1/completions", json=greedy_body(prompt, max_tokens))
                assert response.status_code == 200, response.text
                body = response.json()
                answers.append((body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]))
        return answers

    replies = [tokens for tokens, _ in asyncio.run(turns(first_turns, PD_REPLY))]
    assert duet_status(url)["routing"]["local_prefills"] == 0  # every first turn went through the prefill pool
    # Each session's prompt and reply: 12 blocks, at the routing depths 1-4, 8 and 12.
    held = lambda: sum(stats["prefix_hashes"] for stats in duet_status(url)["pools"]["decode"]["stats"])  # noqa: E731
    wait_for(lambda: held() >= 6 * len(first_turns), 30, "every first turn's history reported by its decode replica")
    second_turns = [prompt + reply + random_prompt(rng, PD_MESSAGE) for prompt, reply in zip(first_turns, replies)]
    answers = asyncio.run(turns(second_turns, 8))
    assert duet_status(url)["routing"]["local_prefills"] == len(second_turns)
    assert [cached for _, cached in answers] == [192] * len(second_turns)
    assert [tokens for tokens, _ in answers] == tiny_offline(second_turns, 8)
    assert settled(cluster, url)["ok"]


def test_a_burst_of_turns_on_one_history_pulls_it_from_its_busy_holder(cluster, tiny_offline, deploy):
    """Eight turns continuing one conversation (its first turn and reply, then a message each),
    sent at once: the decode replica that decoded the reply holds the history, and the router
    reserves turns there until its load (the turns placed or being placed there) passes the
    other decode replica's by more than ``IMBALANCE_THRESHOLD`` (4); the rest are pulls (2 or 3,
    as placements interleave), the holder sending the history's KV and the other replica
    computing each turn and decoding it. Every turn's tokens are the offline engine's, every
    send a pull (new sequences), and every block comes back. Counting only the turns already
    placed (tried once), all eight went to the holder.

    The router prices these turns as it does before any replica has measured its prompt speed
    (``duet.router.balance``), which is what a pull of a tiny model's short history needs: with a
    speed known, computing 200 tokens again is sooner than a pull's hops, and the turns past the
    holder went through the prefill pool (once on a 2-core AMD EPYC, whose prefill replica
    reported its speed from the first turn before the burst came). So every prompt step here is
    16 tokens, too few to measure a speed, whatever the reports' timing."""
    url = deploy("pd-pull", PD_UNMEASURED_APP)
    wait_for(lambda: len(duet_status(url)["pools"]["decode"]["stats"]) == 2, 60, "both decode replicas reporting")
    rng = random.Random(43)
    first_turn = random_prompt(rng, PD_FIRST_TURN)
    turns = 8

    async def run() -> tuple[list[int], list[tuple[int, list[int], list[dict]]]]:
        async with httpx.AsyncClient(timeout=120) as client:
            status, reply, errors = await complete(client, url, greedy_body(first_turn, PD_REPLY))
            assert (status, errors) == (200, [])
            seconds = [first_turn + reply + random_prompt(rng, PD_MESSAGE) for _ in range(turns)]
            answers = await asyncio.gather(*(complete(client, url, greedy_body(prompt, 48)) for prompt in seconds))
            return seconds, answers

    seconds, answers = asyncio.run(run())
    assert [(status, errors) for status, _, errors in answers] == [(200, [])] * turns
    assert [tokens for _, tokens, _ in answers] == tiny_offline(seconds, 48)
    sends = sum(metric(url, "duet:history_sends_total").values())
    pulls = sum(metric(url, "duet:history_pulls_total").values())
    print(f"\n{duet_status(url)['routing']}; history sends {sends}, pulls {pulls}")
    assert pulls == sends >= 1
    assert settled(cluster, url)["ok"]
