"""Tensor- and pipeline-parallel pools over HTTP: each replica and its two workers in one
placement group, prompt KV sent from the ranks that hold each KV head of each layer to those
that need it, whatever the two pools' layouts; tokens as one process gives them."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest

from duet.cluster.config import AppConfigError
from tests.integration.client import NEW_TOKENS, complete, complete_text, greedy_body, metric, random_prompt, settled

pytestmark = pytest.mark.slow

TP1 = {"ray_actor_options": {"num_cpus": 0.05}, "engine": {"num_threads": 1}}
TP2 = {"ray_actor_options": {"num_cpus": 0.01}, "worker_num_cpus": 0.05, "engine": {"tensor_parallel_size": 2, "num_threads": 1}}
PP2 = {"ray_actor_options": {"num_cpus": 0.01}, "worker_num_cpus": 0.05, "engine": {"pipeline_parallel_size": 2, "num_threads": 1}}
LAYOUTS = {"tp2-to-tp2": (TP2, TP2), "tp2-to-tp1": (TP2, TP1), "tp1-to-tp2": (TP1, TP2), "pp2-to-tp2": (PP2, TP2)}


def _app(prefill: dict, decode: dict) -> dict:
    return {
        "mode": "pd",
        "engine": {"max_model_len": 1024, "num_kv_blocks": 2048, "max_num_seqs": 16},
        "prefill": prefill,
        # Every prompt goes through the prefill pool and its KV over the transfer.
        "decode": decode | {"adaptive_local_prefill": False},
        "router": {"ray_actor_options": {"num_cpus": 0}},
    }


def _complete_all(url: str, prompts: list[list[int]], model: str = "tiny") -> list[tuple[int, list[int], list[dict]]]:
    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(complete(client, url, greedy_body(prompt, stream=index % 2 == 1, model=model)) for index, prompt in enumerate(prompts))
            )

    return asyncio.run(run())


@pytest.fixture(scope="module")
def three_kv_heads(tmp_path_factory, smollm2_dir):
    """A tiny Llama with SmolLM2's tokenizer and 3 KV heads (as SmolLM2 has): two ranks hold
    1 and 2 of them. Its greedy tokens from one process, by prompt."""
    from duet import LLM, SamplingParams
    from tests.conftest import make_tiny_llama

    model_dir = make_tiny_llama(
        tmp_path_factory.mktemp("three-kv-heads"), smollm2_dir, hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    )
    llm = LLM(model=str(model_dir), max_model_len=1024, num_kv_blocks=1024)

    def tokens(prompts: list[list[int]]) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
        return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]

    tokens.model_dir = str(model_dir)
    return tokens


# The layouts that take the model of 3 KV heads (1 + 2 on two ranks), gathered into one worker's
# cache or split from one; the others send the tiny model's 2 KV heads, one per rank, rank to rank
# or from two pipeline stages.
UNEVEN_LAYOUTS = {"tp2-to-tp1", "tp1-to-tp2"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pd_across_tensor_parallel_layouts_gives_the_single_process_tokens(
    cluster, tiny_offline, three_kv_heads, deploy, ray_driver, layout
):
    """Guards the KV heads' way across the transfer: each KV head of each layer from the ranks
    (or pipeline stages) that hold it to those that need it, evenly split or not."""
    prefill, decode = LAYOUTS[layout]
    uneven = layout in UNEVEN_LAYOUTS
    app = _app(prefill, decode) | ({"model": three_kv_heads.model_dir} if uneven else {})
    url = deploy(layout, app)
    rng = random.Random(5)
    prompts = [random_prompt(rng, length) for length in (20, 70, 150, 33)]
    results = _complete_all(url, prompts)
    assert [status for status, _, _ in results] == [200] * len(prompts), results
    assert [tokens for _, tokens, _ in results] == (three_kv_heads if uneven else tiny_offline)(prompts)
    # Each tensor-parallel replica's placement group (named as its actor): its own bundle, then
    # one per worker rank. Another application's, even one being deleted, is not counted.
    groups = [
        group for group in ray_driver.util.placement_group_table().values()
        if group["state"] == "CREATED" and group["name"].startswith(f"SERVE_REPLICA::{layout}#")
        and [bundle.get("CPU") for bundle in group["bundles"].values()] == [0.01, 0.05, 0.05]
    ]
    assert len(groups) == (prefill is not TP1) + (decode is not TP1), groups
    assert settled(cluster, url)["ok"]


def test_an_application_the_cluster_cannot_hold_is_refused_before_any_actor_starts(cluster, ray_driver):
    from duet.cluster.app import build_app

    app = _app(TP2, TP2) | {"model_id": "tiny", "model": cluster.tiny_model_dir}
    app["decode"] = app["decode"] | {"worker_num_cpus": 8}
    with pytest.raises(AppConfigError, match="need 16.12 CPUs and the Ray cluster has 2: 14.12 missing"):
        build_app(app)


def test_a_colocated_pool_of_two_pipeline_stages_gives_the_single_process_tokens(cluster, tiny_offline, deploy, ray_driver):
    pool = {"ray_actor_options": {"num_cpus": 0.01}, "worker_num_cpus": 0.05, "engine": {"pipeline_parallel_size": 2, "num_threads": 1}}
    url = deploy("pp2", {"mode": "colocated", "engine": {"max_model_len": 1024, "num_kv_blocks": 2048, "max_num_seqs": 16},
                         "decode": pool, "router": {"ray_actor_options": {"num_cpus": 0}}})
    rng = random.Random(9)
    prompts = [random_prompt(rng, length) for length in (20, 70, 150, 33)]
    results = _complete_all(url, prompts)
    assert [status for status, _, _ in results] == [200] * len(prompts), results
    assert [tokens for _, tokens, _ in results] == tiny_offline(prompts)
    assert settled(cluster, url)["ok"]


def _decode_running(url: str) -> dict[str, int]:
    stats = httpx.get(f"{url}/duet/status", timeout=10).json()["pools"]["decode"]["stats"]
    return {replica["replica_id"]: replica["num_running"] for replica in stats}


def _worker_pids(ray, app: str, pool: str, replica_id: str) -> list[int]:
    """The processes of one replica's worker actors: the live actors it created. (Ray's state
    API needs the dashboard, which `duet up` leaves off; its actor table does not.)"""
    actors = [actor for actor in ray._private.state.actors().values() if actor["State"] == "ALIVE"]
    (replica,) = [actor for actor in actors if actor["Name"] == f"SERVE_REPLICA::{app}#{pool}#{replica_id}"]
    return [
        actor["Pid"] for actor in actors if actor["ActorClassName"] == "_WorkerActor" and actor["OwnerAddress"] == replica["Address"]
    ]


def test_a_dead_worker_fails_its_replica_at_once_and_its_streams_go_on_on_another(cluster, tiny_offline, deploy, ray_driver):
    """One worker process of a TP=2 decode replica is killed mid-stream: the replica's next step
    fails at once (no wait in a collective for the dead rank), its streams are recomputed on the
    other decode replica and read on with the single-process tokens, it refuses new sequences,
    and Serve's health check (every 2 s) replaces it. The streams are under a schema whose state
    is the count of items so far: the recomputed ones go on from it, not from the root."""
    from duet import SamplingParams, StructuredOutputs

    url = deploy("deadworker", _app(TP1, TP2 | {"num_replicas": 2}))
    rng = random.Random(21)
    prompts = [random_prompt(rng, 30) for _ in range(4)]
    array = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 150, "maxItems": 150}
    body = {"max_tokens": 700, "structured_outputs": {"json": array}}
    params = SamplingParams(temperature=0, max_tokens=700, structured_outputs=StructuredOutputs(json=array))
    expected = [output.outputs[0] for output in tiny_offline.llm.generate(prompts, params)]

    async def streams_then_kill():
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [
                asyncio.create_task(complete_text(client, url, greedy_body(prompt, stream=True) | body | {"min_tokens": 0}))
                for prompt in prompts
            ]
            deadline = time.monotonic() + 30
            while not any(_decode_running(url).values()):
                assert time.monotonic() < deadline, "no stream reached a decode replica"
                await asyncio.sleep(0.2)
            running = _decode_running(url)
            victim = max(running, key=running.get)
            pids = _worker_pids(ray_driver, "deadworker", "decode", victim)
            assert len(pids) == 2, pids
            os.kill(pids[-1], signal.SIGKILL)
            killed_at = time.monotonic()
            return await asyncio.gather(*tasks), victim, killed_at

    results, victim, killed_at = asyncio.run(streams_then_kill())
    for (status, text, tokens, errors), want in zip(results, expected):
        assert (status, [error["error"]["message"] for error in errors]) == (200, [])
        assert (text, tokens) == (want.text, want.token_ids)
        assert len(json.loads(text)) == 150
    recomputed = sum(value for labels, value in metric(url, "duet:migrations_total").items() if 'how="recompute"' in labels)
    assert recomputed >= 1
    replica_name = f"SERVE_REPLICA::deadworker#decode#{victim}"
    while any(actor["name"] == replica_name for actor in ray_driver.util.list_named_actors(all_namespaces=True)):
        assert time.monotonic() - killed_at < 60, "Serve did not replace the replica that lost a worker"
        time.sleep(0.5)
    print(f"replica with a dead worker gone {time.monotonic() - killed_at:.1f} s after the kill")
    assert settled(cluster, url)["ok"]
