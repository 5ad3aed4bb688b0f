"""Bad input, authentication, body size and overload: status codes and OpenAI error bodies."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.integration.conftest import MAX_BODY_BYTES, MAX_MODEL_LEN, MAX_QUEUED, MAX_RUNNING

pytestmark = pytest.mark.slow


def _post(cluster, path: str, body, headers: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {cluster.api_key}", "Content-Type": "application/json"} | (headers or {})
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{cluster.url}{path}", content=content, headers=headers, timeout=60)


def _completion(**fields) -> dict:
    return {"model": "smollm2", "prompt": "Hello", "max_tokens": 4} | fields


BAD_REQUESTS = {
    "malformed json": ("/v1/completions", '{"model": "smollm2", "prompt": ', 400, None),
    "not an object": ("/v1/completions", "[1, 2]", 400, None),
    "wrong type": ("/v1/completions", _completion(max_tokens="many"), 400, "max_tokens"),
    "negative max_tokens": ("/v1/completions", _completion(max_tokens=-3), 400, None),
    "temperature below zero": ("/v1/completions", _completion(temperature=-1), 400, None),
    "n of zero": ("/v1/completions", _completion(n=0), 400, "n"),
    "unknown field": ("/v1/completions", _completion(best_guess=True), 400, "best_guess"),
    "missing prompt": ("/v1/completions", {"model": "smollm2"}, 400, "prompt"),
    "prompt too long": ("/v1/completions", _completion(prompt=[42] * (MAX_MODEL_LEN + 10)), 400, "prompt"),
    "max_tokens past the context": ("/v1/completions", _completion(prompt=[42] * 1000, max_tokens=100), 400, "max_tokens"),
    "truncation past the context": ("/v1/completions", _completion(truncate_prompt_tokens=MAX_MODEL_LEN + 1), 400, "truncate_prompt_tokens"),
    "truncation to no token": ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
                                                         "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    "token id outside the vocabulary": ("/v1/completions", _completion(prompt=[10**7]), 400, None),
    # Streamed, the status waits for the first output: a request refused before it is not a 200.
    "token id outside the vocabulary, streamed": ("/v1/completions", _completion(prompt=[10**7], stream=True), 400, None),
    "empty messages": ("/v1/chat/completions", {"model": "smollm2", "messages": []}, 400, "messages"),
    "a turn continued and opened": ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "assistant", "content": "So"}],
                                                            "continue_final_message": True}, 400, "continue_final_message"),
    "bad role": ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "robot", "content": "hi"}]}, 400, None),
    "unknown model": ("/v1/completions", _completion(model="gpt-5"), 404, "model"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_gets_an_openai_error_body(cluster, case):
    path, body, status, param = BAD_REQUESTS[case]
    response = _post(cluster, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    assert "Traceback" not in error["message"]


def test_missing_or_wrong_api_key_gets_401_but_health_and_metrics_stay_open(cluster):
    assert _post(cluster, "/v1/completions", _completion(), {"Authorization": ""}).status_code == 401
    assert _post(cluster, "/v1/completions", _completion(), {"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(f"{cluster.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{cluster.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{cluster.url}/metrics", timeout=10).status_code == 200


def test_the_admin_endpoints_take_the_admin_key_and_no_client_key(cluster):
    """Guards against a client key pinning a pool's size: /duet/ has a key of its own."""
    for path in ("/duet/status", "/duet/integrity"):
        assert httpx.get(f"{cluster.url}{path}", headers={"Authorization": f"Bearer {cluster.api_key}"}, timeout=60).status_code == 401
        assert httpx.get(f"{cluster.url}{path}", headers=cluster.admin_headers, timeout=60).status_code == 200
    scaled = _post(cluster, "/duet/scale", {"pool": "decode", "replicas": 2})
    assert scaled.status_code == 401 and scaled.json()["error"]["type"] == "authentication_error"
    # Admin keys open the admin API only.
    assert _post(cluster, "/v1/completions", _completion(), cluster.admin_headers).status_code == 401


def test_body_over_the_limit_gets_413(cluster):
    for path, headers in (("/v1/completions", None), ("/duet/scale", cluster.admin_headers)):
        response = _post(cluster, path, _completion(prompt="x" * (MAX_BODY_BYTES + 1)), headers)
        assert response.status_code == 413, path
        assert response.json()["error"]["code"] == 413


def test_a_chunked_body_over_the_limit_gets_413(cluster):
    """A body sent in chunks declares no length: the router counts as it reads (``read_body``)."""
    chunks = (b" " * MAX_BODY_BYTES for _ in range(4))
    headers = {"Authorization": f"Bearer {cluster.api_key}", "Content-Type": "application/json"}
    response = httpx.post(f"{cluster.url}/v1/completions", content=chunks, headers=headers, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == 413


def test_burst_over_the_queue_gets_429_and_every_admitted_request_completes(cluster):
    burst = 4 * (MAX_RUNNING + MAX_QUEUED)

    async def send(client: httpx.AsyncClient) -> httpx.Response:
        body = _completion(prompt="Tell me a story about a dragon.", max_tokens=12, ignore_eos=True)
        return await client.post(
            f"{cluster.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {cluster.api_key}"}, timeout=120
        )

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=burst)) as client:
            return await asyncio.gather(*(send(client) for _ in range(burst)))

    responses = asyncio.run(run())
    statuses = sorted(response.status_code for response in responses)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= MAX_RUNNING + MAX_QUEUED
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["type"] == "rate_limit_error"
        else:
            assert response.json()["usage"]["completion_tokens"] == 12
