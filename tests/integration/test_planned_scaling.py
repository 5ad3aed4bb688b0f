"""A pool sized ahead (``autoscaling_config.profile``) on a real cluster: the router meters its
arrivals, reports them to the autoscalers' board, and the pool's policy in Serve's controller
plans from them and the profile, growing the pool before any queue shows the load."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.integration.client import complete, duet_status, greedy_body, random_prompt, wait_for
from tests.integration.test_elastic import SMALL_POOL

pytestmark = pytest.mark.slow

# A decode step of one second: at half that (the lowest correction its replicas' measure can make) no
# number of replicas meets a 200 ms TPOT, so any arrivals plan the pool at its maximum, on any machine.
SLOW_STEPS = {
    "prompt": {"fit": {"base_s": 0.001, "per_token_s": 0.0001, "per_token_context_s": 0.0}},
    "decode": {"fit": {"base_s": 1.0, "per_row_s": 0.01, "per_row_context_s": 0.0}},
    "settings": {"max_num_batched_tokens": 512, "max_num_seqs": 64, "num_blocks": 512, "block_size": 16},
}


def test_arrivals_alone_grow_a_planned_pool_and_every_answer_is_exact(cluster, tiny_offline, deploy, tmp_path):
    """Guards the planner's wiring: four short requests leave the decode pool's KV, waiting and TPOT
    far below the reactive rules' targets, so only the arrivals the router reported, read by the
    policy with the profile, can ask for a second replica."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"machine": {"cpu": "made up", "cores": 2}, "pools": {"decode": SLOW_STEPS}}))
    scaling = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 30, "metrics_interval_s": 0.5,
               "look_back_period_s": 2, "cooldown_s": 0}
    url = deploy("planned", {
        "mode": "pd",
        "engine": {"max_model_len": 1024, "num_kv_blocks": 512, "max_num_seqs": 64},
        "prefill": SMALL_POOL,
        "decode": SMALL_POOL | {"autoscaling_config": scaling | {"profile": str(profile)}},
        "router": {"ray_actor_options": {"num_cpus": 0}},
        "roles": {"move": False},
    })
    assert (duet_status(url)["pools"]["decode"].get("autoscaler") or {}).get("reason") != "planned"  # nothing arrived yet
    rng = random.Random(3)
    prompts = [random_prompt(rng, 24) for _ in range(4)]

    async def send():
        async with httpx.AsyncClient(timeout=120) as client:
            return [await complete(client, url, greedy_body(prompt, 8, stream=True)) for prompt in prompts]

    results = asyncio.run(send())
    for (status, tokens, errors), want in zip(results, tiny_offline(prompts, 8)):
        assert (status, errors, tokens) == (200, [], want)

    def planned() -> dict | None:
        record = duet_status(url)["pools"]["decode"].get("autoscaler") or {}
        return record if record.get("reason", "").removesuffix(", bounded") == "planned" and record.get("target") == 2 else None

    wait_for(lambda: planned() is not None, 60, "the decode pool planned at two replicas from the arrivals")
    numbers = planned()["numbers"]
    assert numbers["rate"] > 0 and numbers["prompt_tokens"] == 24 and numbers["planned"] > 2
    assert numbers["kv_used_blocks"] < numbers["blocks_per_replica"] * numbers["kv_target"]  # the reactive rule saw no need
