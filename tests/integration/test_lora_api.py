"""LoRA adapters over HTTP through PD: a request's ``model`` names its adapter, the prefill pool
computes the prompt's KV with it and the decode pool (n-gram drafts on) decodes with it;
``/v1/models`` lists the base and its adapters; greedy output equals transformers on the base
with the adapter merged by PEFT, requests of every adapter and the base mixed at once. Adapters
loaded and unloaded at run time (vLLM's admin routes), more of them than a replica holds
(``max_loras``): each request answered by its own, loads and evictions in ``/metrics``."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import re
import time

import httpx
import pytest

from tests.conftest import TINY_VOCAB, make_tiny_llama
from tests.integration.client import complete, greedy_body
from tests.integration.conftest import NGRAM
from tests.reference import compare_to_reference, hf_greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed"),
]

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def lora_app(cluster, ray_driver, tmp_path_factory, tiny_tokenizer_dir):
    """A tiny Llama served by PD with two adapters (replicas holding four at a time), six more
to load at run time, and the references of a few prompts under each."""
    from ray import serve

    from duet.cluster.app import build_app
    from tests.duet.test_lora import ADAPTERS, make_adapter, merged_model

    root = tmp_path_factory.mktemp("lora-app")
    base = make_tiny_llama(root / "base", tiny_tokenizer_dir, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    adapters, references = {}, {"tiny-lora": hf_greedy(base, prompts, NEW_TOKENS)}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        adapters[name] = str(make_adapter(base, root / name, rank, alpha, targets, rslora, seed))
        references[name] = hf_greedy(merged_model(base, adapters[name], root / f"{name}-merged"), prompts, NEW_TOKENS)
        assert [ref.token_ids for ref in references[name]] != [ref.token_ids for ref in references["tiny-lora"]]
    late = {}
    for seed, targets in enumerate((["q_proj", "o_proj"], ["gate_proj", "down_proj"], ["k_proj", "v_proj", "up_proj"]) * 2):
        name = f"late{seed}"
        late[name] = str(make_adapter(base, root / name, 4 << (seed % 2), 8, targets, False, 20 + seed))
        references[name] = hf_greedy(merged_model(base, late[name], root / f"{name}-merged"), prompts, NEW_TOKENS)
    foreign = make_tiny_llama(root / "other", tiny_tokenizer_dir, hidden_size=96, intermediate_size=128)
    late["foreign"] = str(make_adapter(foreign, root / "foreign", 4, 8, ["q_proj"], False, 0))
    tiny = {"ray_actor_options": {"num_cpus": 0.01}, "engine": {"num_threads": 1}}
    args = {
        "model_id": "tiny-lora", "model": str(base), "mode": "pd",
        "engine": {"max_model_len": 512, "num_kv_blocks": 512, "max_num_seqs": 16, "lora_modules": adapters, "max_loras": 4},
        "prefill": tiny,
        # Every prompt through the prefill pool, whatever its length.
        "decode": tiny | {"engine": {"num_threads": 1, "speculative_config": NGRAM}, "local_prefill_threshold": 0, "adaptive_local_prefill": False},
        "router": {"ray_actor_options": {"num_cpus": 0}},
    }
    serve.run(build_app(args), name="tiny-lora", route_prefix="/tiny-lora")
    url = f"{cluster.url}/tiny-lora"
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    yield url, prompts, references, late
    serve.delete("tiny-lora")


def test_models_lists_the_base_and_its_adapters(lora_app):
    url, _, _, _ = lora_app
    cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [(card["id"], card.get("parent")) for card in cards] == [
        ("tiny-lora", None), ("attention", "tiny-lora"), ("everywhere", "tiny-lora"),
    ]
    response = httpx.post(f"{url}/v1/completions", json=greedy_body([5, 6, 7], model="nope"), timeout=30)
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


@pytest.mark.parametrize("stream", [False, True])
def test_every_adapter_and_the_base_at_once_through_pd_match_peft_merged(lora_app, stream):
    url, prompts, references, _ = lora_app
    jobs = [(model, index) for model in ("tiny-lora", "attention", "everywhere") for index in range(len(prompts))]
    random.Random(2).shuffle(jobs)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(complete(client, url, greedy_body(prompts[index], NEW_TOKENS, stream, model=model)) for model, index in jobs)
            )

    for (model, index), (status, tokens, errors) in zip(jobs, asyncio.run(run())):
        assert (status, errors) == (200, [])
        assert compare_to_reference(tokens, references[model][index], f"{model} prompt {index}") is None


def _run_all(url, prompts, references, models):
    """Every prompt under every one of ``models`` at once; each answer checked against its reference."""
    jobs = [(model, index) for model in models for index in range(len(prompts))]
    random.Random(4).shuffle(jobs)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(complete(client, url, greedy_body(prompts[index], NEW_TOKENS, True, model=model)) for model, index in jobs))

    for (model, index), (status, tokens, errors) in zip(jobs, asyncio.run(run())):
        assert (status, errors) == (200, [])
        assert compare_to_reference(tokens, references[model][index], f"{model} prompt {index}") is None


def _metric(text: str, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{re.escape(name)}{{(.*)}} (\S+)$", line)
        if match and all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            total += float(match.group(2))
    return total


def test_adapters_loaded_at_run_time_are_served_more_than_replicas_hold_and_unloaded(lora_app):
    url, prompts, references, late = lora_app
    admin = httpx.Client(base_url=url, timeout=120)
    response = admin.post("/v1/load_lora_adapter", json={"lora_name": "foreign", "lora_path": late["foreign"]})
    assert response.status_code == 400 and "an adapter of another base model" in response.json()["error"]["message"]
    response = admin.post("/v1/load_lora_adapter", json={"lora_name": "attention", "lora_path": late["late0"]})
    assert response.status_code == 400 and "already been loaded" in response.json()["error"]["message"]
    loaded = [f"late{index}" for index in range(6)]
    for name in loaded:
        response = admin.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": late[name]})
        assert response.status_code == 200, response.text
    assert [card["id"] for card in admin.get("/v1/models").json()["data"]] == ["tiny-lora", "attention", "everywhere", *loaded]
    # Eight adapters, round-robin, and the base at once, each replica holding four adapters at a time.
    _run_all(url, prompts, references, ["tiny-lora", "attention", "everywhere", *loaded])
    deadline = time.monotonic() + 30  # the replicas report their stats every few seconds
    while True:
        metrics = admin.get("/metrics").text
        if _metric(metrics, "duet:lora_evictions_total", stage="decode") > 0 and _metric(metrics, "duet:lora_evictions_total", stage="prefill") > 0:
            break
        assert time.monotonic() < deadline, "no replica reported evicting an adapter"
        time.sleep(1)
    assert 0 < _metric(metrics, "duet:lora_adapters_loaded") <= 2 * 4
    for name in (*loaded, "attention"):
        assert _metric(metrics, "duet:lora_requests_total", lora_name=name) >= len(prompts)
        assert _metric(metrics, "duet:lora_generation_tokens_total", lora_name=name) >= len(prompts) * NEW_TOKENS
    for name in loaded:
        assert admin.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "late0"}).status_code == 404
    response = admin.post("/v1/completions", json=greedy_body(prompts[0], NEW_TOKENS, model="late1"))
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    assert [card["id"] for card in admin.get("/v1/models").json()["data"]] == ["tiny-lora", "attention", "everywhere"]
