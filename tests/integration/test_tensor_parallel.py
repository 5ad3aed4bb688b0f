"""Tensor-parallel pools over HTTP: each replica and its TP=2 workers in one placement group,
prompt KV sent rank to rank (each rank its own KV heads), tokens as one process gives them."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from duet.cluster.config import AppConfigError
from tests.integration.client import complete, greedy_body, random_prompt, settled

pytestmark = pytest.mark.slow

TP2 = {"ray_actor_options": {"num_cpus": 0.01}, "worker_num_cpus": 0.05, "engine": {"tensor_parallel_size": 2, "num_threads": 1}}


def _tp2_app() -> dict:
    return {
        "mode": "pd",
        "engine": {"max_model_len": 1024, "num_kv_blocks": 2048, "max_num_seqs": 16},
        "prefill": TP2,
        # Every prompt goes through the prefill pool and its KV over the transfer.
        "decode": TP2 | {"adaptive_local_prefill": False},
        "router": {"ray_actor_options": {"num_cpus": 0}},
    }


def test_pd_at_tp2_gives_the_single_process_tokens(cluster, tiny_offline, deploy, ray_driver):
    url = deploy("tp2", _tp2_app())
    rng = random.Random(5)
    prompts = [random_prompt(rng, length) for length in (20, 70, 150, 33)]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(complete(client, url, greedy_body(prompt, stream=index % 2 == 1)) for index, prompt in enumerate(prompts))
            )

    results = asyncio.run(run())
    assert [status for status, _, _ in results] == [200] * len(prompts)
    assert [tokens for _, tokens, _ in results] == tiny_offline(prompts)
    # Each replica's placement group: its own bundle, then one per worker rank.
    groups = [
        group for group in ray_driver.util.placement_group_table().values()
        if group["state"] == "CREATED" and [bundle.get("CPU") for bundle in group["bundles"].values()] == [0.01, 0.05, 0.05]
    ]
    assert len(groups) == 2, groups
    assert settled(cluster, url)["ok"]


def test_an_application_the_cluster_cannot_hold_is_refused_before_any_actor_starts(cluster, ray_driver):
    from duet.cluster.app import build_app

    app = _tp2_app() | {"model_id": "tiny", "model": cluster.tiny_model_dir}
    app["decode"] = app["decode"] | {"worker_num_cpus": 8}
    with pytest.raises(AppConfigError, match="need 16.12 CPUs and the Ray cluster has 2: 14.12 missing"):
        build_app(app)
