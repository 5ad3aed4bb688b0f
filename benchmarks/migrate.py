"""``duet bench migrate``: how long a client's stream pauses when its sequence moves to another
decode replica, by KV (its replica is scaled down: the KV ships over) and by recompute (its
replica is killed: the router re-admits prompt and tokens so far elsewhere).

It pins the decode pool of an autoscaled cluster (``configs/autoscale.yaml``) at two replicas,
starts ``--streams`` greedy streams of ``--context`` prompt tokens, and once each is decoding
either pins the pool at one replica (Serve stops one, whose sequences move by KV) or kills one
decode replica's actor. Each stream's pause is its longest gap between two token events; the moved
streams are the ones with the longest pauses (as many as the router counted migrations), set
beside the median gap between two token events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time

from duet.benchmarks.workloads import SAFE_TOKEN_RANGE


async def _stream(client, url: str, model: str, prompt: list[int], max_tokens: int, times: list[float]) -> str:
    """Stream one completion, appending the arrival time of each event that carries tokens (a
    speculative step may bring several) to ``times``; its error message, if it ended with one."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "return_token_ids": True}
    error = ""
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                elif event["choices"][0].get("token_ids"):
                    times.append(time.perf_counter())
    return error


def _migrations(client, url: str) -> dict[str, float]:
    found = {}
    for line in client.get(f"{url}/metrics").text.splitlines():
        match = re.match(r'^duet:migrations_total\{how="(\w+)".*\} (\S+)$', line)
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def _decode_replicas(client, url: str) -> list[str]:
    return [stats["replica_id"] for stats in client.get(f"{url}/duet/status").json()["pools"]["decode"]["stats"]]


def _pin(client, url: str, replicas: int | None, wait_s: float = 180) -> None:
    client.post(f"{url}/duet/scale", json={"pool": "decode", "replicas": replicas}).raise_for_status()
    deadline = time.monotonic() + wait_s
    while replicas is not None and len(_decode_replicas(client, url)) != replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the decode pool did not reach {replicas} replicas")
        time.sleep(1)


def _kill_busiest(client, url: str, app: str) -> None:
    import ray

    stats = client.get(f"{url}/duet/status").json()["pools"]["decode"]["stats"]
    busiest = max(stats, key=lambda replica: replica["num_running"])["replica_id"]
    actors = [actor for actor in ray.util.list_named_actors(all_namespaces=True) if actor["name"].endswith(f"#decode#{busiest}")
              and actor["name"].startswith(f"SERVE_REPLICA::{app}#")]
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)


def measure(url: str, app: str, model: str, how: str, args) -> dict:
    import httpx

    with httpx.Client(timeout=30) as client:
        _pin(client, url, 2)
        time.sleep(3)  # the new replica's first reports reach the router
        before = _migrations(client, url)
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(*SAFE_TOKEN_RANGE) for _ in range(args.context)] for _ in range(args.streams)]

        times: list[list[float]] = [[] for _ in prompts]
        placement: dict[str, int] = {}

        async def run():
            async with httpx.AsyncClient(timeout=600) as aclient:
                tasks = [asyncio.create_task(_stream(aclient, url, model, prompt, args.max_tokens, mine)) for prompt, mine in zip(prompts, times)]
                deadline = time.monotonic() + 300
                while min(len(mine) for mine in times) < args.decoded_before and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)  # every stream decoding
                stats = (await aclient.get(f"{url}/duet/status")).json()["pools"]["decode"]["stats"]
                placement.update({replica["replica_id"]: replica["num_running"] for replica in stats})
                if how == "kv":
                    await asyncio.to_thread(client.post, f"{url}/duet/scale", json={"pool": "decode", "replicas": 1})
                else:
                    await asyncio.to_thread(_kill_busiest, client, url, app)
                return await asyncio.gather(*tasks)

        errors = asyncio.run(run())
        after = _migrations(client, url)
        _pin(client, url, None)
    moved = int(sum(after.values()) - sum(before.values()))
    pauses = sorted((max(b - a for a, b in zip(mine, mine[1:])) for mine in times if len(mine) > 1), reverse=True)
    gaps = [b - a for mine in times for a, b in zip(mine, mine[1:])]
    return {
        "how": how, "streams": len(prompts), "placement": placement, "errors": sum(1 for error in errors if error), "moved": moved,
        "by": {key: after.get(key, 0) - before.get(key, 0) for key in after},
        "moved_pause_ms": [round(pause * 1e3) for pause in pauses[:moved]],
        "median_gap_ms": round(statistics.median(gaps) * 1e3, 1) if gaps else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="duet bench migrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/autoscale.yaml", help="an autoscaled cluster, brought up and taken down")
    parser.add_argument("--url", default=None, help="a running cluster instead (its decode pool autoscaled, max_replicas >= 2)")
    parser.add_argument("--app", default="duet", help="the application's name (to find its replicas' actors)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=1000, help="prompt tokens of each stream")
    parser.add_argument("--max-tokens", type=int, default=900, help="long enough to outlast the pool's downscale_delay_s")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--decoded-before", type=int, default=16, help="token events every stream has had when they move")
    parser.add_argument("--ways", default="kv,recompute")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from duet.cluster.deploy import use_loopback_ray

    use_loopback_ray()  # it kills a replica through this machine's Ray
    url = args.url
    if url is None:
        from duet.cluster.deploy import up

        url = up(args.config).urls[0]
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", logging_level="ERROR")
    try:
        for how in args.ways.split(","):
            figures = measure(url, args.app, args.model, how, args)
            print(f"by {how}: {figures['moved']} of {figures['streams']} streams moved (running per replica before: "
                  f"{figures['placement']}; {figures['by']}), {figures['errors']} errors; "
                  f"their pauses {figures['moved_pause_ms']} ms, against a median gap of {figures['median_gap_ms']} ms", flush=True)
    finally:
        if args.url is None:
            from duet.cluster.deploy import down

            down()
