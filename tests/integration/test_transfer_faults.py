"""Faults on the KV wire of a real cluster, injected on the prefill pool's replicas through
``DUET_KV_FAULTS`` (``duet.kv_transfer.faults``): a run corrupted on the way is refused by the
decode replica's checksum and the sequence recomputed, so the client still gets the offline
engine's tokens; a transfer that stalls times out instead of hanging, and under
``on_transfer_failure: fail`` its client gets a 503 with ``Retry-After`` while the next request
goes over a new pair. Each test ends with no block held anywhere."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from duet.kv_transfer.faults import FAULTS_ENV
from tests.integration.client import complete, greedy_body, settled, stage_total

pytestmark = pytest.mark.slow

PROMPTS = [list(range(200 + 10 * index, 240 + 10 * index)) for index in range(4)]


def _faulty_app(faults: str, on_transfer_failure: str = "recompute", timeout_s: float = 30) -> dict:
    """PD where every prompt goes through the prefill pool, whose replica injects ``faults``."""
    prefill_options = {"num_cpus": 0.1, "runtime_env": {"env_vars": {FAULTS_ENV: faults}}}
    return {
        "mode": "pd",
        "engine": {"max_model_len": 1024, "num_kv_blocks": 2048, "max_num_seqs": 16},
        "prefill": {"ray_actor_options": prefill_options, "engine": {"num_threads": 1}},
        "decode": {
            "ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}, "adaptive_local_prefill": False,
            "on_transfer_failure": on_transfer_failure,
        },
        "kv_transfer": {"timeout_s": timeout_s},
        "router": {"ray_actor_options": {"num_cpus": 0}},
    }


def _one_by_one(url: str, prompts: list[list[int]]) -> list[tuple[int, list[int], list[dict]]]:
    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return [await complete(client, url, greedy_body(prompt)) for prompt in prompts]

    return asyncio.run(run())


def test_kv_corrupted_on_the_wire_is_refused_and_recomputed_never_served(cluster, tiny_offline, deploy):
    """Guards against answering with KV that changed on the way (vLLM's NIXL path has returned
    another request's answer with a 200): the first two transfers arrive with a flipped bit;
    the decode replica's checksum refuses them, and every client gets the offline tokens."""
    url = deploy("corrupt", _faulty_app("corrupt=2"))
    answers = _one_by_one(url, PROMPTS)
    assert [(status, errors) for status, _, errors in answers] == [(200, [])] * len(PROMPTS)
    assert [tokens for _, tokens, _ in answers] == tiny_offline(PROMPTS)
    assert stage_total(url, "duet:kv_transfer_failures_total", "decode", 2) == 2
    assert settled(cluster, url)["ok"]


def test_a_stalled_transfer_times_out_and_fails_only_its_request_under_the_fail_policy(cluster, tiny_offline, deploy):
    """Guards against a hung prefill replica hanging its client: the first transfer stalls past
    ``kv_transfer.timeout_s``; its client gets a 503 naming the lost KV, with ``Retry-After``;
    the next request, sent over a new pair once the stalled one breaks, gets the offline tokens."""
    url = deploy("stall", _faulty_app("stall=1:6", on_transfer_failure="fail", timeout_s=2))
    body = greedy_body(PROMPTS[0])
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["type"] == "service_unavailable" and "KV did not arrive" in error["message"]
    answers = _one_by_one(url, PROMPTS[1:])
    assert [tokens for _, tokens, _ in answers] == tiny_offline(PROMPTS[1:])
    assert stage_total(url, "duet:kv_transfer_failures_total", "decode", 1) == 1
    assert settled(cluster, url)["ok"]
