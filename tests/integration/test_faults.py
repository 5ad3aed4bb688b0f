"""What a newcomer and a hostile client broke, against a real cluster: hostile bodies beside
well-formed requests, a burst with cancellations over the KV transfer, a decode replica killed
mid-stream, a prefill replica killed with prompts in flight, fan-out against admission, and
what a local cluster listens on. Each test ends with
every replica's KV bookkeeping check and a normal request answered correctly.

The load and fault tests run on the ``stress`` application (a tiny random Llama, PD, every
prompt through the prefill pool, two decode replicas): it restarts in seconds and decodes
hundreds of streams at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import time

import httpx
import pytest

from tests.integration.client import complete, greedy_body, metric, moved, random_prompt, settled
from tests.integration.conftest import MAX_QUEUED, MAX_RUNNING, listening_addresses

pytestmark = pytest.mark.slow

def _assert_answers_correctly(url: str, tiny_offline) -> None:
    prompt = list(range(100, 140))

    async def one():
        async with httpx.AsyncClient(timeout=60) as client:
            return await complete(client, url, greedy_body(prompt))

    status, tokens, errors = asyncio.run(one())
    assert (status, errors) == (200, [])
    assert tokens == tiny_offline([prompt])[0]


def _raw(**fields) -> str:
    return json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8] * 5, "max_tokens": 4} | fields)


# name -> (raw body, status, param the error must name)
HOSTILE = {
    "seed past 64 bits": (_raw(seed=2**64), 400, "seed"),
    "seed below 64 bits": (_raw(seed=-(2**63) - 1), 400, "seed"),
    "stop id past 64 bits with min_tokens": (_raw(stop_token_ids=[2**70], min_tokens=2), 400, "stop_token_ids"),
    "negative stop id with min_tokens": (_raw(stop_token_ids=[-1], min_tokens=2), 400, "stop_token_ids"),
    "JSON nested 1000 deep": ('{"model": "tiny", "prompt": ' + "[" * 1000 + "]" * 1000 + "}", 400, None),
    "5000-digit integer": ('{"model": "tiny", "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", 400, None),
    "lone surrogate in a prompt": ('{"model": "tiny", "prompt": "hi \\ud800 there", "max_tokens": 4}', 400, None),
    "lone surrogate in a message": (
        '{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 4}', 400, None,
    ),
    "NaN temperature": ('{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, None),
    "65 prompts": (_raw(prompt=[[5, 6, 7]] * 65), 400, "prompt"),
    "token id past the vocabulary": (_raw(prompt=[2**62]), 400, None),
    # Valid, at the edges of what the engine represents: answered, and harmless to others.
    "temperature 1e-45": (_raw(temperature=1e-45), 200, None),
    "repetition penalty 1e-38": (_raw(repetition_penalty=1e-38, temperature=0.7, seed=1), 200, None),
    "largest seed, n=16": (_raw(seed=2**63 - 1, n=16), 200, None),
    "largest stop id with min_tokens": (_raw(stop_token_ids=[2**63 - 1], min_tokens=2), 200, None),
    "huge top_k, tiny top_p, min_p 1": (_raw(top_k=10**30, top_p=1e-300, min_p=1.0, temperature=2.0), 200, None),
}


def test_hostile_bodies_get_openai_errors_and_fail_no_one_else(cluster, tiny_offline):
    """Guards items 3, 6 and 9 of the report: values past int64 failed the engine step and with
    it every request in the batch (500 events mid-stream), after which the engine kept failing;
    deep JSON, huge literals and lone surrogates got a plain-text 500; temperature 1e-45 gave
    token 0 forever. Well-formed requests running beside them must all get their exact tokens."""
    rng = random.Random(1)
    prompts = [random_prompt(rng, length) for length in (5, 17, 40, 90, 160, 300) * 3]
    expected = tiny_offline(prompts)
    url = cluster.stress_url

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
            normal = [complete(client, url, greedy_body(prompt, stream=index % 2 == 0)) for index, prompt in enumerate(prompts)]
            hostile = [
                client.post(f"{url}/v1/completions" if "message" not in name else f"{url}/v1/chat/completions",
                            content=body, headers={"content-type": "application/json"})
                for _ in range(3) for name, (body, _, _) in HOSTILE.items()
            ]
            return await asyncio.gather(*normal), await asyncio.gather(*hostile)

    normal, hostile = asyncio.run(run())
    for index, (status, tokens, errors) in enumerate(normal):
        assert (status, errors) == (200, []), f"well-formed request {index} failed: {errors}"
        assert tokens == expected[index], f"well-formed request {index} got other tokens"
    for (name, (_, status, param)), response in zip(list(HOSTILE.items()) * 3, hostile):
        assert response.status_code == status, f"{name}: {response.status_code} {response.text[:300]}"
        if status != 200:
            error = response.json()["error"]
            assert error["code"] == status and error["type"] == "invalid_request_error" and error["message"], name
            assert "Traceback" not in error["message"] and "RayTaskError" not in error["message"], name
            if param is not None:
                assert error["param"] == param, f"{name}: {error}"
    assert settled(cluster, url)["ok"]
    _assert_answers_correctly(url, tiny_offline)


def test_unknown_routes_and_methods_get_openai_errors(cluster):
    """Guards FastAPI's own {"detail": ...} bodies for 404 and 405."""
    for method, path, status in (("GET", "/nope", 404), ("DELETE", "/v1/completions", 405), ("GET", "/v1/completions", 405)):
        response = httpx.request(method, f"{cluster.stress_url}{path}", timeout=10)
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert response.json()["error"]["code"] == status


def test_a_burst_with_cancellations_breaks_no_transfer_and_leaks_no_block(cluster, tiny_offline):
    """Guards items 4 and 5: a few hundred concurrent PD requests broke transfer pairs ('pair is
    broken', 'expected transfer A, got B', gloo timeouts) and aborted transfers left blocks
    held on the decode replica. Now every request the client did not cancel gets its exact
    tokens, no transfer fails, and every block comes back."""
    rng = random.Random(2)
    url = cluster.stress_url
    failures_before = sum(metric(url, "duet:kv_transfer_failures_total").values())
    requests = []
    for index in range(300):
        prompt = random_prompt(rng, rng.choice([20, 60, 150, 300, 600]))
        cancel_after = rng.uniform(0.05, 3.0) if rng.random() < 0.2 else None
        requests.append((prompt, rng.choice([4, 12, 24]), cancel_after))
    expected = {}
    for max_tokens in (4, 12, 24):
        chosen = [prompt for prompt, tokens, _ in requests if tokens == max_tokens]
        expected.update(zip(map(tuple, chosen), tiny_offline(chosen, max_tokens)))

    async def one(client, prompt, max_tokens, cancel_after):
        call = complete(client, url, greedy_body(prompt, max_tokens, stream=True))
        if cancel_after is None:
            return await call
        try:
            return await asyncio.wait_for(call, cancel_after)
        except asyncio.TimeoutError:
            return None

    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=400)) as client:
            return await asyncio.gather(*(one(client, *request) for request in requests))

    results = asyncio.run(run())
    completed = 0
    for (prompt, max_tokens, cancel_after), result in zip(requests, results):
        if result is None:
            continue
        status, tokens, errors = result
        assert (status, errors) == (200, []), errors
        assert tokens == expected[tuple(prompt)]
        completed += 1
    assert completed >= 200
    report = settled(cluster, url)
    assert report["ok"], report
    assert sum(metric(url, "duet:kv_transfer_failures_total").values()) == failures_before
    assert sum(metric(url, "duet:kv_transfers_total").values()) > 0
    _assert_answers_correctly(url, tiny_offline)


def test_fan_out_counts_every_sequence_against_admission(cluster):
    """Guards item 7: 256 prompts x n=4 counted as one request against the running limit.
    On the pd application (2 sequences may run, 2 requests queue) a request of 2 prompts takes
    both seats: of 3 small requests sent beside it, 2 queue and the third is refused at once."""
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    fan_out = {"model": "smollm2", "prompt": ["Count slowly to forty:", "Name forty animals:"], "max_tokens": 40,
               "ignore_eos": True, "stream": True}
    small = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}

    async def run():
        async with httpx.AsyncClient(timeout=120, headers=headers) as client:
            async with client.stream("POST", f"{cluster.url}/v1/completions", json=fan_out) as stream:
                assert stream.status_code == 200
                lines = stream.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass  # admitted and producing: its sequences hold the seats
                status = (await client.get(f"{cluster.url}/duet/status", headers=cluster.admin_headers)).json()["admission"]
                others = [asyncio.create_task(client.post(f"{cluster.url}/v1/completions", json=small)) for _ in range(3)]
                done, _ = await asyncio.wait(others, timeout=5, return_when=asyncio.FIRST_COMPLETED)
                refused = [task.result().status_code for task in done]
                async for _ in lines:
                    pass
            return status, refused, [(await task).status_code for task in others]

    status, refused, finals = asyncio.run(run())
    assert status["running_sequences"] == MAX_RUNNING
    assert refused == [429]
    assert sorted(finals) == [200] * MAX_QUEUED + [429]


def _kill_replica(ray, app: str, pool: str, replica_id: str | None = None) -> str:
    """Kill a replica's actor (one of the pool's, or the one named); its id."""
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(f"SERVE_REPLICA::{app}#{pool}#")]
    if replica_id is not None:
        actors = [a for a in actors if a["name"].endswith(f"#{replica_id}")]
    assert actors, f"no {pool} replica {replica_id or ''} in {app}"
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
    return actors[0]["name"].rsplit("#", 1)[1]


def test_a_decode_replica_killed_mid_stream_its_streams_go_on_on_another(cluster, tiny_offline, ray_driver):
    """A decode replica dies (killed) with streams running on it: each of them goes on on the
    other decode replica, recomputed from its prompt and the tokens already sent, and the
    client reads one stream with the offline engine's exact tokens. (Before #10 calls pinned to
    the dead replica spun Serve's routing loop forever; before #12 its streams ended with a 503.)"""
    url = cluster.stress_url
    rng = random.Random(3)
    prompts = [random_prompt(rng, 24) for _ in range(4)]
    moved_before = moved(url)

    async def streams_then_kill():
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(complete(client, url, greedy_body(prompt, 900, stream=True))) for prompt in prompts]
            await asyncio.sleep(1.5)
            assert not any(task.done() for task in tasks)
            decode = (await client.get(f"{url}/duet/status")).json()["pools"]["decode"]["stats"]
            busiest = max(decode, key=lambda stats: stats["num_running"])
            assert busiest["num_running"] > 0, decode
            _kill_replica(ray_driver, "stress", "decode", busiest["replica_id"])
            return await asyncio.gather(*tasks), busiest["num_running"]

    results, num_killed = asyncio.run(streams_then_kill())
    expected = tiny_offline(prompts, 900)
    for (status, tokens, errors), want in zip(results, expected):
        assert (status, errors) == (200, [])
        assert tokens == want
    # Each sequence on the killed replica went on elsewhere: recomputed, or shed by KV just before.
    assert moved(url) - moved_before >= num_killed
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and len(cluster_replicas(url, "decode")) < 2:
        time.sleep(1)  # Serve replaces the dead replica
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert settled(cluster, url)["ok"]
    _assert_answers_correctly(url, tiny_offline)


def test_a_prefill_replica_killed_with_prompts_in_flight_all_complete(cluster, tiny_offline, ray_driver):
    """The prefill replica dies with prompts queued and in their prefill: each of them is
    computed on its decode replica instead (which frees the blocks it had reserved for the
    transfer), and every client gets the offline engine's exact tokens.

    The kill follows a fresh report of prompts waiting on the replica (killed at the first
    answer instead, it found the queue drained in every round of one CI run). Reports are half a
    second apart and the tiny model prefills tens of prompts a second, so the queue may still
    have drained by the kill (the prompts in the router then wait for its replacement, and none
    falls back): up to three rounds, until one falls back. A prompt whose prefill answered just
    before the kill, its KV still on the way, once left its client waiting 120 s in CI; the
    decode side's deadline on a receive (``KVConnectorScheduler``), counted from the prefill's
    answer that the router passes on, now bounds that wait."""
    url = cluster.stress_url
    rng = random.Random(4)
    fallbacks_before = sum(metric(url, "duet:prefill_fallbacks_total").values())

    async def requests_then_kill(prompts):
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
            tasks = [asyncio.create_task(complete(client, url, greedy_body(prompt, 8))) for prompt in prompts]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                stats = (await client.get(f"{url}/duet/status")).json()["pools"]["prefill"]["stats"]
                if any(replica["num_waiting"] >= 8 and replica["age_s"] < 0.25 for replica in stats):
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the prefill replica never reported prompts waiting on it")
            _kill_replica(ray_driver, "stress", "prefill")
            return await asyncio.gather(*tasks)

    for _ in range(3):
        prompts = [random_prompt(rng, 900) for _ in range(96)]
        results = asyncio.run(requests_then_kill(prompts))
        for (status, tokens, errors), want in zip(results, tiny_offline(prompts, 8)):
            assert (status, errors) == (200, [])
            assert tokens == want
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not cluster_replicas(url, "prefill"):
            time.sleep(1)
        if sum(metric(url, "duet:prefill_fallbacks_total").values()) > fallbacks_before:
            break
    assert sum(metric(url, "duet:prefill_fallbacks_total").values()) > fallbacks_before
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert settled(cluster, url)["ok"]
    _assert_answers_correctly(url, tiny_offline)


def cluster_replicas(url: str, pool: str) -> list[str]:
    """The pool's replicas that report stats, as the router sees them."""
    return [stats["replica_id"] for stats in httpx.get(f"{url}/duet/status", timeout=10).json()["pools"][pool]["stats"]]


def test_everything_a_local_cluster_starts_listens_on_loopback_only(cluster):
    """Guards item 8: `duet up` left Ray's GCS on *:6379 and its client server and agents on the
    machine's external address, and torch's TCPStore and Serve's replicas listened on every
    interface."""
    new = listening_addresses() - cluster.listeners_before
    assert new, "the cluster opened no listening socket?"
    exposed = []
    for listener in new:
        address = ipaddress.ip_address(listener.rsplit(":", 1)[0])
        mapped = getattr(address, "ipv4_mapped", None)
        if not (address.is_loopback or (mapped is not None and mapped.is_loopback)):
            exposed.append(listener)
    assert not exposed, f"listening beyond loopback: {sorted(exposed)}"


def _boundary_stop(text_pieces: list[str], boundary: int) -> str:
    """Two characters on each side of the boundary between token ``boundary`` and the next."""
    before = "".join(text_pieces[: boundary + 1])
    return before[-2:] + text_pieces[boundary + 1][:2]


@pytest.mark.parametrize("boundary", [0, 5], ids=["prefill|decode", "decode|decode"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_across_tokens_ends_the_text_where_offline_generation_does(cluster, boundary, stream):
    """Guards the text moved to the router: a stop string made of the prefill replica's first
    token and the decode replica's second (or of two decode steps) ends the output exactly where
    the offline engine ends it, text and tokens, and the sequence stops in both pools."""
    from duet import LLM, SamplingParams

    llm = LLM(model=cluster.tiny_model_dir, max_model_len=1024, num_kv_blocks=256)
    tokenizer = llm.get_tokenizer()
    prompt = list(range(200, 240))
    for attempt in range(20):  # a prompt whose text around the boundary is long enough to cut
        prompt = [token + attempt for token in prompt]
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
        pieces = [tokenizer.decode(free.token_ids[: index + 1])[len(tokenizer.decode(free.token_ids[:index])):] for index in range(20)]
        if len("".join(pieces[: boundary + 1])) >= 2 and len(pieces[boundary + 1]) >= 2 and "".join(pieces) == free.text:
            stop = _boundary_stop(pieces, boundary)
            if free.text.index(stop) == len("".join(pieces[: boundary + 1])) - 2:
                break
    else:
        pytest.skip("no prompt gave a usable boundary")
    # Past EOS by ignore_eos: min_tokens would hold the stop string off too.
    offline = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert offline.finish_reason == "stop" and offline.text == free.text[: free.text.index(stop)]
    body = greedy_body(prompt, 20, stream=stream) | {"min_tokens": 0, "ignore_eos": True, "stop": [stop]}

    async def ask():
        async with httpx.AsyncClient(timeout=60) as client:
            if not stream:
                return (await client.post(f"{cluster.stress_url}/v1/completions", json=body)).json()["choices"][0]
            text, tokens, reason = "", [], None
            async with client.stream("POST", f"{cluster.stress_url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choice = json.loads(line[6:])["choices"][0]
                        text, tokens, reason = text + choice["text"], tokens + choice["token_ids"], choice["finish_reason"] or reason
            return {"text": text, "token_ids": tokens, "finish_reason": reason}

    choice = asyncio.run(ask())
    assert (choice["text"], choice["finish_reason"]) == (offline.text, "stop")
    assert choice["token_ids"] == offline.token_ids
    assert settled(cluster, cluster.stress_url)["ok"]
