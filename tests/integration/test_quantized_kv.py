"""A PD cluster with ``kv_cache_dtype: int8`` on both pools, over HTTP: every client gets the
offline engine's tokens with the same cache dtype (the codes and their scales cross the wire
unchanged), the transfer bytes on ``/metrics`` are what the quantized blocks weigh (17/64 of
fp32's for the tiny model's 16-wide heads; 65/256 for SmolLM2's 64), and ``/metrics`` names
the cache's dtype and blocks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from duet import LLM, SamplingParams
from tests.integration.client import NEW_TOKENS, complete, greedy_body, metric, settled, stage_total

pytestmark = pytest.mark.slow

PROMPTS = [list(range(300 + 7 * index, 340 + 9 * index)) for index in range(4)]


def _int8_app() -> dict:
    return {
        "mode": "pd",
        "engine": {"max_model_len": 1024, "num_kv_blocks": 1024, "max_num_seqs": 16, "kv_cache_dtype": "int8"},
        "prefill": {"ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}},
        "decode": {"ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}, "adaptive_local_prefill": False},
        "router": {"ray_actor_options": {"num_cpus": 0}},
    }


def test_int8_kv_pd_over_http_gives_the_offline_tokens_for_a_quarter_of_the_bytes(cluster, deploy, tiny_llama_dir):
    url = deploy("int8kv", _int8_app())

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return [await complete(client, url, greedy_body(prompt)) for prompt in PROMPTS]

    answers = asyncio.run(run())
    offline = LLM(model=str(tiny_llama_dir), max_model_len=1024, num_kv_blocks=512, kv_cache_dtype="int8")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    assert [(status, errors) for status, _, errors in answers] == [(200, [])] * len(PROMPTS)
    assert [tokens for _, tokens, _ in answers] == [output.outputs[0].token_ids for output in offline.generate(PROMPTS, params)]

    arch, block_size = offline.engine.model_config, offline.engine.block_size
    blocks = sum(-(-len(prompt) // block_size) for prompt in PROMPTS)
    row_bytes = {"int8": arch.head_dim + 1, "float32": arch.head_dim * 4}
    expected = {dtype: arch.num_layers * 2 * arch.num_kv_heads * blocks * block_size * row for dtype, row in row_bytes.items()}
    assert stage_total(url, "duet:kv_transfer_bytes_total", "decode", expected["int8"]) == expected["int8"]
    assert expected["int8"] / expected["float32"] == pytest.approx(17 / 64)
    info = metric(url, "vllm:cache_config_info")
    assert info and all('cache_dtype="int8"' in labels and 'num_gpu_blocks="1024"' in labels for labels in info)
    assert settled(cluster, url)["ok"]
