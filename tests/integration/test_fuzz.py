"""Random and malformed bodies, searched for by hypothesis, posted to a running cluster (the
``stress`` application) while well-formed requests run beside them.

Guards the edge as a whole rather than the cases already found: whatever a client sends
(random JSON, wrong types, numbers out of range or at the extremes, invalid UTF-8 and lone
surrogates, deep nesting, huge literals, unknown fields, empty and enormous prompts, huge
``n``, long stop lists), the answer is a 200 or a 4xx with an OpenAI error body, never a 5xx;
the well-formed requests beside them get their exact tokens; the replicas stay up and their
KV bookkeeping holds. A failure shrinks to the smallest body that causes it.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.client import complete, greedy_body, random_prompt, settled

pytestmark = pytest.mark.slow

FIELDS = [
    "model", "prompt", "messages", "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "max_tokens", "max_completion_tokens",
    "logprobs", "top_logprobs", "echo", "suffix", "stream", "stream_options", "user", "return_token_ids", "skip_special_tokens",
    "tools", "tool_choice", "parallel_tool_calls", "logit_bias", "best_of", "prompt_logprobs", "chat_template_kwargs",
]
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e-45, 5e-324, 1e308, -1e308, 1e-300]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=40))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)
TOKEN_LISTS = st.one_of(
    st.lists(st.integers(0, 49151), max_size=40),
    st.lists(st.integers(-(2**64), 2**64), min_size=1, max_size=5),
    st.lists(st.lists(st.integers(0, 49151), max_size=6), max_size=70),
    st.just([7] * 5000),
)
PROMPTS = st.one_of(st.text(max_size=60), st.just(""), st.just("x" * 20000), TOKEN_LISTS, st.lists(st.text(max_size=10), max_size=5))
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot", ""])}, optional={
        "content": st.one_of(st.text(max_size=40), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}))),
        "name": SCALARS,
    }),
    max_size=4,
)
TOOLS = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "no spaces"])}, optional={
            "parameters": st.one_of(JSON, st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})),
        })},
    ),
    max_size=3,
)
SPECIAL = {
    "tools": TOOLS,
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required"]),
        st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "x"])})}),
    ),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-5, 60000).map(str), st.text(max_size=4)), NUMBERS, max_size=4),
    "model": st.one_of(st.just("tiny"), SCALARS),
    "prompt": PROMPTS,
    "messages": MESSAGES,
    "n": st.one_of(st.integers(-3, 20), st.just(10**9)),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3), st.just(["a"] * 2000)),
    "max_tokens": st.one_of(st.integers(-2, 40), NUMBERS),
    "stream": st.booleans(),
}


@st.composite
def shaped_body(draw) -> dict:
    """A body shaped like a request: the model and a prompt or messages most of the time, any
    subset of the fields with values of their own kind or of any kind, perhaps unknown fields."""
    body = {"model": "tiny"} if draw(st.booleans()) else {}
    if draw(st.booleans()):
        body["prompt"] = draw(PROMPTS)
    else:
        body["messages"] = draw(MESSAGES)
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        kind = SPECIAL.get(name, NUMBERS)
        body[name] = draw(st.one_of(kind, JSON) if draw(st.booleans()) else kind)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=12))] = draw(JSON)
    body.setdefault("max_tokens", 4)  # a valid body by chance stays short
    return body


def _lone_surrogate(body: dict) -> bytes:
    return json.dumps(body).replace('"tiny"', '"ti\\ud800ny"').encode()


RAW_BODIES = st.one_of(
    st.binary(max_size=200),
    st.just(b'{"model": "tiny", "prompt": "\xff\xfe bad utf-8"}'),
    st.integers(1, 20000).map(lambda depth: b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"),
    st.integers(10, 20000).map(lambda digits: b'{"model": "tiny", "prompt": "hi", "n": ' + b"9" * digits + b"}"),
    shaped_body().map(_lone_surrogate),
    JSON.map(lambda value: json.dumps(value).encode()),
)
RESPONSES_ITEMS = st.lists(st.one_of(
    MESSAGES.map(lambda messages: messages[0] if messages else {}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": SCALARS, "name": st.sampled_from(["f", "x"]), "arguments": st.one_of(st.text(max_size=12), JSON)}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call_output", "web_search_call", "reasoning"]), "call_id": SCALARS, "output": SCALARS}),
    JSON,
), max_size=4)


@st.composite
def responses_body(draw) -> dict:
    """A body shaped like a Responses API request (``/v1/responses``)."""
    body = {"model": "tiny", "input": draw(st.one_of(st.text(max_size=40), RESPONSES_ITEMS, JSON)), "max_output_tokens": 4}
    options = {
        "instructions": SCALARS, "tools": TOOLS.map(lambda tools: [{"type": "function"} | tool["function"] for tool in tools]),
        "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries({"type": st.just("function"), "name": SCALARS})),
        "text": st.one_of(JSON, st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}, optional={"schema": JSON})})),
        "stream": st.booleans(), "temperature": NUMBERS, "max_output_tokens": NUMBERS, "previous_response_id": SCALARS, "store": SCALARS,
        "parallel_tool_calls": SCALARS,
    }
    for name in draw(st.lists(st.sampled_from(sorted(options)), max_size=4, unique=True)):
        body[name] = draw(options[name])
    return body


BODIES = st.one_of(shaped_body().map(lambda body: json.dumps(body).encode()), RAW_BODIES)
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
HOSTILE = st.one_of(st.tuples(PATHS, BODIES), st.tuples(st.just("/v1/responses"), responses_body().map(lambda body: json.dumps(body).encode())))


def _check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
    if response.status_code == 200:
        return
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code, error
    assert error["message"] and "Traceback" not in error["message"], error
    if response.status_code == 429:
        assert "retry-after" in response.headers


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(hostile=st.lists(HOSTILE, min_size=16, max_size=16))
def test_random_and_malformed_bodies_get_openai_errors_and_fail_no_one_else(cluster, tiny_offline, hostile):
    url = cluster.stress_url
    rng = random.Random(len(hostile))
    prompts = [random_prompt(rng, length) for length in (9, 40, 130)]
    expected = tiny_offline(prompts)

    async def run():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
            normal = [complete(client, url, greedy_body(prompt, stream=index == 1)) for index, prompt in enumerate(prompts)]
            sent = [client.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}) for path, body in hostile]
            return await asyncio.gather(*normal), await asyncio.gather(*sent)

    normal, answers = asyncio.run(run())
    for response in answers:
        _check_answer(response)
    assert [(status, errors) for status, _, errors in normal] == [(200, [])] * len(prompts)
    assert [tokens for _, tokens, _ in normal] == expected
    assert settled(cluster, url)["ok"]
