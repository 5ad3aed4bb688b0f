"""A Qwen 3, a Qwen 3 MoE and a Gemma 3 checkpoint (windows of 24 tokens: every prompt is past
them) served by PD over HTTP (prompts computed on the prefill pool, their KV shipped, decoded
with n-gram speculation): every client gets transformers' greedy tokens on the same weights, and
no block leaks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import make_tiny_model
from tests.integration.client import NEW_TOKENS, complete, greedy_body, settled, stage_total
from tests.reference import compare_to_reference, hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [list(range(300 + 7 * index, 340 + 9 * index)) for index in range(3)] + [[11, 12, 13, 11, 12, 13, 11, 12]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3, "adaptive": False}


def _pd_app(model_dir: str) -> dict:
    return {
        "model": model_dir,
        "mode": "pd",
        "engine": {"max_model_len": 512, "num_kv_blocks": 512, "max_num_seqs": 16},
        "prefill": {"ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}},
        "decode": {
            "ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1, "speculative_config": NGRAM},
            "adaptive_local_prefill": False,
        },
        "router": {"ray_actor_options": {"num_cpus": 0}},
    }


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe", "gemma3"])
def test_a_family_served_by_pd_over_http_gives_transformers_tokens(cluster, deploy, smollm2_dir, tmp_path, family):
    model_dir = make_tiny_model(tmp_path / family, smollm2_dir, family)
    references = hf_greedy(model_dir, PROMPTS, NEW_TOKENS)
    url = deploy(f"arch-{family}", _pd_app(str(model_dir)))

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(complete(client, url, greedy_body(prompt, stream=index % 2 == 1)) for index, prompt in enumerate(PROMPTS)))

    answers = asyncio.run(run())
    assert [(status, errors) for status, _, errors in answers] == [(200, [])] * len(PROMPTS)
    for index, ((_, tokens, _), reference) in enumerate(zip(answers, references)):
        assert compare_to_reference(tokens, reference, f"{family} over PD, prompt {index}") is None
    assert stage_total(url, "duet:kv_transfer_bytes_total", "decode", 1) > 0  # the prompts' KV came from the prefill pool
    assert settled(cluster, url)["ok"]
