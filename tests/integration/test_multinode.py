"""duet on several Ray nodes: ``configs/cluster-example.yaml`` deployed by ``duet up`` on Ray's
multi-node test cluster (a raylet per node, on this machine: ``tests/integration/nodes.py``),
the prefill pool's tensor-parallel ranks on two nodes labelled for it and the decode pool on two
others, so that every KV transfer crosses nodes; then a decode node removed under live streams.

The file's machine-sized settings are scaled to this one (CPUs, replica counts, the model, its
HTTP address on 127.0.0.1 and one proxy, on the head: proxies on every node would all bind the
same address here); its placement (the pools' label selectors), engine settings and
speculative decoding are deployed as written."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.client import complete, greedy_body, moved, random_prompt
from tests.integration.conftest import _free_port

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "cluster-example.yaml"
LAYOUT = {
    "head": {"num_cpus": 1, "labels": {"duet-pool": "router"}},
    # The prefill replica's two tensor-parallel ranks (0.6 CPUs each) cannot share a node.
    "prefill-a": {"num_cpus": 1, "labels": {"duet-pool": "prefill"}},
    "prefill-b": {"num_cpus": 1, "labels": {"duet-pool": "prefill"}},
    # One decode replica fits on each decode node.
    "decode-a": {"num_cpus": 1, "labels": {"duet-pool": "decode"}},
    "decode-b": {"num_cpus": 1, "labels": {"duet-pool": "decode"}},
}
STREAM_TOKENS = 600


def _scaled_to_this_machine(port: int, model_dir: str) -> dict:
    config = yaml.safe_load(EXAMPLE.read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    config["proxy_location"] = "HeadOnly"
    args = config["applications"][0]["args"]
    args |= {"model_id": "tiny", "model": model_dir}
    # fp32: "auto" is bf16 where the CPU has it, and bf16's sums differ with the batch.
    args["engine"] |= {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 16, "kv_cache_memory_gib": 0.25, "num_threads": 1}
    # One prefill replica of two tensor-parallel ranks, spread over the prefill nodes.
    args["prefill"] |= {"num_replicas": 1, "worker_num_cpus": 0.6, "placement_group_strategy": "SPREAD"}
    args["prefill"]["ray_actor_options"]["num_cpus"] = 0.2
    args["prefill"]["engine"] |= {"tensor_parallel_size": 2}
    args["decode"]["num_replicas"] = 2
    args["decode"]["ray_actor_options"]["num_cpus"] = 0.6  # two would not fit on one decode node
    args["router"]["num_replicas"] = 1
    args["router"]["ray_actor_options"]["num_cpus"] = 0
    return config


@pytest.fixture(scope="module")
def nodes_app(tmp_path_factory, tiny_llama_dir):
    from tests.integration.nodes import start

    workdir = tmp_path_factory.mktemp("nodes")
    config = workdir / "cluster.yaml"
    port = _free_port()
    config.write_text(yaml.safe_dump(_scaled_to_this_machine(port, str(tiny_llama_dir))))
    with start(LAYOUT, workdir) as nodes:
        duet = str(Path(sys.executable).parent / "duet")
        try:
            up = nodes.run(duet, "up", str(config), timeout=600)
            assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
            yield nodes, f"http://127.0.0.1:{port}"
        finally:
            nodes.run(duet, "down", timeout=120)


def _replicas(url: str) -> dict[str, list[dict]]:
    pools = httpx.get(f"{url}/duet/status", timeout=30).json()["pools"]
    return {pool: info["stats"] for pool, info in pools.items()}


def _wait_for_replicas(url: str, counts: dict[str, int], timeout_s: float = 120) -> dict[str, list[dict]]:
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = _replicas(url)
        if all(len(replicas.get(pool, [])) == count for pool, count in counts.items()) or time.monotonic() > deadline:
            return replicas
        time.sleep(1)


def test_the_pools_run_on_their_labelled_nodes_and_answer_exactly_across_them(nodes_app, tiny_offline):
    """Each pool's replicas run on the nodes its label selector names: the router on the head,
    the prefill replica's two ranks one on each prefill node, one decode replica on each decode
    node. Prompts computed
    across the prefill nodes decode on the decode nodes with the offline engine's tokens: their
    KV crossed nodes, from two ranks to one."""
    nodes, url = nodes_app
    ids = nodes.node_ids
    replicas = _wait_for_replicas(url, {"prefill": 1, "decode": 2})
    assert [stats["node_id"] for stats in replicas["prefill"]][0] in (ids["prefill-a"], ids["prefill-b"])
    actors = nodes.actors()
    ranks = [actor["node_id"] for actor in actors if actor["class"] == "_WorkerActor"]
    assert sorted(ranks) == sorted([ids["prefill-a"], ids["prefill-b"]])
    # What must outlive any other node: the routers (clients' streams) and the autoscalers' board.
    assert {actor["node_id"] for actor in actors if actor["class"] in ("ServeReplica:duet:router", "Board")} == {ids["head"]}
    assert sorted(stats["node_id"] for stats in replicas["decode"]) == sorted([ids["decode-a"], ids["decode-b"]])
    rng = random.Random(11)
    prompts = [random_prompt(rng, 200) for _ in range(6)]  # past the example's local_prefill_threshold (64)

    async def run():
        # One after another: each finds the prefill pool idle, and the router sends it there (sent at once, a new
        # deployment's burst is shared with the idle decode replicas: duet.router.balance).
        async with httpx.AsyncClient(timeout=120) as client:
            return [await complete(client, url, greedy_body(prompt, 16)) for prompt in prompts]

    results = asyncio.run(run())
    for (status, tokens, errors), want in zip(results, tiny_offline(prompts, 16)):
        assert (status, errors) == (200, [])
        assert tokens == want
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # replicas report about once a second
        replicas = _replicas(url)
        if sum(stats["transfers"] for stats in replicas["prefill"]) >= len(prompts):
            break
        time.sleep(0.5)
    assert sum(stats["transfers"] for stats in replicas["prefill"]) >= len(prompts)


def test_a_decode_node_removed_under_live_streams_every_stream_finishes_exactly(nodes_app, tiny_offline):
    """Eight streams run on the two decode nodes; one of those nodes is removed (its raylet and
    every process on it killed, as when a machine is lost). Its streams go on on the other
    decode node, and every client reads the offline engine's exact tokens; new requests are
    answered."""
    nodes, url = nodes_app
    ids = nodes.node_ids
    rng = random.Random(12)
    prompts = [random_prompt(rng, 100) for _ in range(8)]
    moved_before = moved(url)

    async def streams_then_remove():
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.create_task(complete(client, url, greedy_body(prompt, STREAM_TOKENS, stream=True))) for prompt in prompts]
            deadline = time.monotonic() + 60
            busiest = None
            while time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                decode = (await client.get(f"{url}/duet/status")).json()["pools"]["decode"]["stats"]
                if sum(stats["num_running"] for stats in decode) == len(prompts):
                    busiest = max(decode, key=lambda stats: stats["num_running"])
                    break
            assert busiest is not None and not any(task.done() for task in tasks)
            name = next(name for name, node_id in ids.items() if node_id == busiest["node_id"])
            assert name.startswith("decode-")
            await asyncio.to_thread(nodes.remove, name)
            return await asyncio.gather(*tasks), name, busiest["num_running"]

    results, removed, num_lost = asyncio.run(streams_then_remove())
    for (status, tokens, errors), want in zip(results, tiny_offline(prompts, STREAM_TOKENS)):
        assert (status, errors) == (200, [])
        assert tokens == want
    assert moved(url) - moved_before >= num_lost  # each went on on the other node
    survivors = [stats["node_id"] for stats in _replicas(url)["decode"]]
    assert ids[removed] not in survivors and survivors
    status, tokens, errors = asyncio.run(_one(url, prompts[0]))
    assert (status, errors, tokens) == (200, [], tiny_offline([prompts[0]], 16)[0])


async def _one(url: str, prompt: list[int]):
    async with httpx.AsyncClient(timeout=120) as client:
        return await complete(client, url, greedy_body(prompt, 16))
