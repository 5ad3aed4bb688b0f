"""#38 on a real cluster: the only decode replica of a PD application dies under live streams,
and its prefill replica takes the decode role until Serve's replacement serves, with the pools on
static cores and sharing them."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.integration.client import (
    complete, complete_text, duet_status, greedy_body, metric, random_prompt, running_per_replica, settled, wait_for,
)

pytestmark = pytest.mark.slow

SMALL_POOL = {"ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}}


def _stages(url: str, pool: str) -> list[str]:
    """The role each reporting replica of a pool serves."""
    return [stats["stage"] for stats in duet_status(url)["pools"][pool]["stats"]]


@pytest.mark.parametrize("cores", ["static", "shared"])
def test_a_decode_pool_of_one_killed_a_prefill_replica_takes_the_role_until_the_replacement(
    cluster, tiny_offline, deploy, ray_driver, cores
):
    """#38: the only decode replica dies under live streams. The prefill replica takes the decode
    role at once: the live streams finish on it with the offline engine's exact tokens, new
    requests are answered there before Serve's replacement is up (the time is printed, not
    asserted), and once the replacement serves the prefill replica goes home; nothing leaks. The
    same with the pools sharing the cores (``cores.share``): the replica's share follows its role."""
    from tests.integration.test_faults import _kill_replica

    url = deploy(f"roles-{cores}", {
        "mode": "pd", "engine": {"max_model_len": 1024, "num_kv_blocks": 4096, "max_num_seqs": 32},
        "prefill": SMALL_POOL, "decode": SMALL_POOL, "router": {"ray_actor_options": {"num_cpus": 0}},
        "cores": {"share": cores == "shared"},
    })
    rng = random.Random(38)
    prompts = [random_prompt(rng, 24) for _ in range(3)]
    fresh = random_prompt(rng, 30)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            seen: list[list[int]] = [[] for _ in prompts]
            bodies = [greedy_body(prompt, 600, stream=True) for prompt in prompts]
            tasks = [asyncio.create_task(complete_text(client, url, body, ids)) for body, ids in zip(bodies, seen)]
            deadline = time.monotonic() + 60
            while not all(len(ids) >= 2 for ids in seen):
                assert time.monotonic() < deadline and not any(task.done() for task in tasks), "streams decoding before the kill"
                await asyncio.sleep(0.1)
            killed = _kill_replica(ray_driver, f"roles-{cores}", "decode")
            killed_at = time.monotonic()
            for attempt in range(120):  # bounded: a refusal (503) is retried
                sent_at = time.monotonic()
                status, tokens, errors = await complete(client, url, greedy_body(fresh, 16))
                if status == 200:
                    break
                await asyncio.sleep(0.5)
            answered_s = time.monotonic() - killed_at
            print(f"\nanswered {answered_s:.1f} s after the only decode replica was killed ({attempt} refused; the answer took "
                  f"{time.monotonic() - sent_at:.1f} s)")
            # The role as the prefill replica last reported it: its stats come every second or
            # so, and an answer can be quicker than the report (bounded wait).
            deadline = time.monotonic() + 10
            while (stages := _stages(url, "prefill")) != ["decode"] and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            return killed, answered_s, (status, tokens, errors), stages, await asyncio.gather(*tasks)

    killed, answered_s, (status, tokens, errors), stages, streams = asyncio.run(run())
    assert (status, errors) == (200, []) and tokens == tiny_offline([fresh], 16)[0]
    assert stages == ["decode"]
    for (stream_status, _, stream_tokens, stream_errors), want in zip(streams, tiny_offline(prompts, 600)):
        assert (stream_status, stream_errors) == (200, [])
        assert stream_tokens == want
    wait_for(lambda: any(rid != killed for rid in running_per_replica(url, "decode")), 120, "Serve's replacement decode replica")
    wait_for(lambda: _stages(url, "prefill") == ["prefill"], 60, "the prefill replica back in its role")
    assert settled(cluster, url)["ok"]
    changes = {labels.split('reason="')[1].split('"')[0]: value for labels, value in metric(url, "duet:role_changes_total").items()}
    assert changes.get("no_decode_replica", 0) >= 1 and changes.get("home", 0) >= 1, changes
