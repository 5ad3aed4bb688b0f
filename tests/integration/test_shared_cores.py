"""A PD application whose replicas share the machine's cores step by step (``cores.share``):
greedy output through both pools equals the offline engine's, decode replicas and the prefill
replica each computed on their share of the cores, and no block is left in use."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from duet.cores import DIRECTORY, EngineState
from tests.integration.client import complete, greedy_body, random_prompt, settled

pytestmark = pytest.mark.slow

SHARED_APP = {
    "mode": "pd",
    "engine": {"max_model_len": 1024, "num_kv_blocks": 2048, "max_num_seqs": 16, "max_num_batched_tokens": 128},
    "prefill": {"ray_actor_options": {"num_cpus": 0.1}},
    "decode": {
        "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1}, "adaptive_local_prefill": False,
        "engine": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    },
    "router": {"ray_actor_options": {"num_cpus": 0}},
    "cores": {"share": True},
}


def test_pools_sharing_the_cores_give_the_offline_engines_tokens(cluster, tiny_offline, deploy):
    url = deploy("shared", SHARED_APP)
    rng = random.Random(38)
    prompts = [random_prompt(rng, rng.choice([20, 150, 400])) for _ in range(12)]
    expected = tiny_offline(prompts, 24)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(complete(client, url, greedy_body(prompt, 24, stream=index % 2 == 0)) for index, prompt in enumerate(prompts)))

    results = asyncio.run(run())
    for index, ((status, tokens, errors), want) in enumerate(zip(results, expected)):
        assert (status, errors) == (200, []), f"request {index}"
        assert tokens == want, f"request {index}"
    states = [EngineState.unpack(path.read_bytes()[: EngineState.size]) for path in DIRECTORY.glob("*.state")]
    assert {state.decode for state in states if state.steps} == {True, False}  # both roles computed
    report = settled(cluster, url)
    assert report["ok"], report
