"""Overload on a real cluster: a bounded burst at ten times the rate an application sustains.

Guards graceful degradation: every request is answered, either admitted and completed with all
its tokens, or refused early with 429 (queue full) or 503 (its predicted wait passes
``router.max_queue_wait_s``) and ``Retry-After``; no admitted request waited past that limit; the Ray workers' memory stays bounded; and once the burst is over the application
answers correctly again with no KV block held.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from tests.integration.client import complete, greedy_body, metric, settled

pytestmark = pytest.mark.slow

MAX_QUEUE_WAIT_S = 2.0
OVERLOAD_APP = {
    "mode": "pd",
    "engine": {"max_model_len": 1024, "num_kv_blocks": 2048, "max_num_seqs": 16},
    "prefill": {"ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}},
    "decode": {"ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}, "adaptive_local_prefill": False},
    "router": {
        "ray_actor_options": {"num_cpus": 0}, "max_running_sequences": 8, "max_queued_requests": 64,
        "max_queue_wait_s": MAX_QUEUE_WAIT_S,
    },
}
PROMPT = list(range(300, 340))
NEW_TOKENS = 32


def ray_workers_rss_mib() -> float:
    """Resident memory of every Ray worker process on this machine (their titles start ``ray::``)."""
    total_kib = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if not file.read().startswith(b"ray::"):
                    continue
            with open(f"/proc/{pid}/status") as file:
                total_kib += next(int(line.split()[1]) for line in file if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total_kib / 1024


async def _timed(client: httpx.AsyncClient, url: str) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    response = await client.post(f"{url}/v1/completions", json=greedy_body(PROMPT, NEW_TOKENS))
    return response, time.perf_counter() - started


async def _sustained_rate(client: httpx.AsyncClient, url: str) -> float:
    """Requests per second the application completes with its running limit full."""
    await _timed(client, url)  # the predictor's first measurement, and warm replicas
    started = time.perf_counter()
    answers = await asyncio.gather(*(_timed(client, url) for _ in range(16)))
    assert [response.status_code for response, _ in answers] == [200] * 16
    return 16 / (time.perf_counter() - started)


async def _burst(client: httpx.AsyncClient, url: str, rate: float, seconds: float) -> list[tuple[httpx.Response, float]]:
    count = min(400, round(rate * seconds))
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(_timed(client, url)))
        await asyncio.sleep(1 / rate)
    return await asyncio.gather(*tasks)


def test_a_burst_at_ten_times_the_sustained_rate_degrades_gracefully_and_recovers(cluster, tiny_offline, deploy):
    url = deploy("overload", OVERLOAD_APP)

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=500)) as client:
            sustained = await _sustained_rate(client, url)
            memory_before = ray_workers_rss_mib()
            answers = await _burst(client, url, 10 * sustained, seconds=8)
            return sustained, memory_before, ray_workers_rss_mib(), answers

    sustained, memory_before, memory_after, answers = asyncio.run(run())
    statuses = [response.status_code for response, _ in answers]
    counts = {status: statuses.count(status) for status in sorted(set(statuses))}
    print(f"sustained {sustained:.1f} req/s; burst of {len(answers)} at {10 * sustained:.1f} req/s: {counts}; "
          f"Ray workers' memory {memory_before:.0f} -> {memory_after:.0f} MiB")
    assert set(counts) <= {200, 429, 503} and counts.get(200, 0) >= 8 and counts.get(429, 0) + counts.get(503, 0) > 0
    for response, _ in answers:
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] == NEW_TOKENS
            continue
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["type"] == {429: "rate_limit_error", 503: "service_unavailable"}[response.status_code], error
    # No admitted request waited in the router's queue past the limit (the router's own clock:
    # the client's includes the HTTP proxy's backlog on two busy cores).
    waits = metric(url, "vllm:request_queue_time_seconds_bucket")
    within = next(count for labels, count in waits.items() if 'le="2.5"' in labels)  # the first bucket past 2 s
    assert within == sum(metric(url, "vllm:request_queue_time_seconds_count").values())
    assert memory_after - memory_before < 300, "the Ray workers grew by more than 300 MiB during the burst"
    assert settled(cluster, url)["ok"]

    async def after():
        async with httpx.AsyncClient(timeout=60) as client:
            return await complete(client, url, greedy_body(PROMPT, NEW_TOKENS))

    assert asyncio.run(after()) == (200, tiny_offline([PROMPT], NEW_TOKENS)[0], [])
