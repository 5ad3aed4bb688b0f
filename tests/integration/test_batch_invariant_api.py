"""``batch_invariant: true`` over HTTP through PD: a request's tokens and logprobs, computed on the
prefill pool and decoded on the decode pool, are bit for bit the same sent alone and sent amid 15
other clients' requests, and its tokens are those of the offline engine alone."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from duet import LLM, SamplingParams
from tests.conftest import make_tiny_llama
from tests.duet.test_batch_invariant import HEADS_OF_64
from tests.integration.client import random_prompt, settled

pytestmark = pytest.mark.slow

NEW_TOKENS = 16


def _body(prompt: list[int], max_tokens: int = NEW_TOKENS, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "return_token_ids": True} | extra


async def _logprobs(client: httpx.AsyncClient, url: str, body: dict) -> tuple[list[int], dict]:
    response = await client.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]


def test_a_request_over_pd_gets_the_same_bits_alone_and_amid_other_clients(cluster, deploy, smollm2_dir, tmp_path):
    model_dir = make_tiny_llama(tmp_path / "heads-64", smollm2_dir, **HEADS_OF_64)
    url = deploy("batch-invariant", {
        "model": str(model_dir),
        "mode": "pd",
        "engine": {"max_model_len": 512, "num_kv_blocks": 512, "max_num_seqs": 32, "batch_invariant": True, "num_threads": 1},
        "prefill": {"ray_actor_options": {"num_cpus": 0.1}, "engine": {"max_num_batched_tokens": 96}},
        "decode": {"ray_actor_options": {"num_cpus": 0.1}, "adaptive_local_prefill": False},
        "router": {"ray_actor_options": {"num_cpus": 0}},
    })
    rng = random.Random(3)
    target = random_prompt(rng, 150)
    greedy = _body(target, temperature=0, logprobs=3)
    seeded = _body(target, temperature=0.9, seed=5, logprobs=3)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            alone = [await _logprobs(client, url, body) for body in (greedy, seeded)]
            others = [_body(random_prompt(rng, rng.randint(5, 200)), rng.randint(2, 30), temperature=0) for _ in range(15)]
            crowded = await asyncio.gather(*(_logprobs(client, url, body) for body in [*others[:7], greedy, seeded, *others[7:]]))
            return alone, crowded[7:9]

    alone, crowded = asyncio.run(run())
    assert crowded == alone
    offline = LLM(model=str(model_dir), max_model_len=512, batch_invariant=True)
    assert alone[0][0] == offline.generate([target], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS))[0].outputs[0].token_ids
    assert settled(cluster, url)["ok"]
