"""What the integration tests do as clients of a cluster: bodies, requests streamed or not,
metrics read off ``/metrics``, and the KV bookkeeping report once the replicas are idle."""

from __future__ import annotations

import json
import random
import time

import httpx

from duet.benchmarks.soak import metric_values

NEW_TOKENS = 12


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 49000) for _ in range(length)]


def greedy_body(prompt: list[int], max_tokens: int = NEW_TOKENS, stream: bool = False, model: str = "tiny") -> dict:
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
        "temperature": 0, "return_token_ids": True, "stream": stream,
    }


async def complete(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, list[int], list[dict]]:
    """Status, generated token ids and error events (or error body) of one request, streamed or not."""
    status, _, tokens, errors = await complete_text(client, url, body)
    return status, tokens, errors


async def complete_text(
    client: httpx.AsyncClient, url: str, body: dict, token_ids: list[int] | None = None
) -> tuple[int, str, list[int], list[dict]]:
    """``complete``, with the text too; a stream's token ids gather in ``token_ids`` (when given)
    as they come, for a caller that acts mid-stream."""
    if not body.get("stream"):
        response = await client.post(f"{url}/v1/completions", json=body)
        payload = response.json()
        if response.status_code != 200:
            return response.status_code, "", [], [payload]
        return 200, payload["choices"][0]["text"], payload["choices"][0]["token_ids"], []
    text, tokens, errors = "", token_ids if token_ids is not None else [], []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code, "", [], [json.loads(await response.aread())]
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event)
                else:
                    text += event["choices"][0]["text"]
                    tokens += event["choices"][0]["token_ids"]
        return response.status_code, text, tokens, errors


def metric(url: str, name: str) -> dict[str, float]:
    """A metric's samples on ``/metrics``, by their label string."""
    return metric_values(httpx.get(f"{url}/metrics", timeout=10).text, name)


def moved(url: str) -> float:
    """Sequences moved between replicas, recomputed or by KV (a busy replica sheds some by KV to
    one that took the decode role: ``duet.router.roles``)."""
    return sum(metric(url, "duet:migrations_total").values())


def stage_total(url: str, name: str, stage: str, expected: float, timeout_s: float = 15) -> float:
    """The sum of a metric's samples from one pool, once it reaches ``expected`` (replicas' stats
    are pulled every second or so) or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        total = sum(value for labels, value in metric(url, name).items() if f'stage="{stage}"' in labels)
        if total >= expected or time.monotonic() > deadline:
            return total
        time.sleep(0.5)


def settled(cluster, url: str, timeout_s: float = 30) -> dict:
    """The integrity report once no replica of the application holds a block."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        usage = metric(url, "vllm:kv_cache_usage_perc")
        if usage and not any(usage.values()):
            break
        time.sleep(0.5)
    return cluster.integrity(url)


def duet_status(url: str) -> dict:
    return httpx.get(f"{url}/duet/status", timeout=10).json()


def running_per_replica(url: str, pool: str) -> dict[str, int]:
    """Sequences running per replica of a pool (the replicas that report stats)."""
    return {stats["replica_id"]: stats["num_running"] for stats in duet_status(url)["pools"][pool]["stats"]}


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
