"""Tool calling over HTTP with the official ``openai`` client's loop (call, run the function, send
its result, get the answer), streamed through the client's stream helper and not: SmolLM2
through PD (its template renders no tools: duet writes them into the messages), a tiny Qwen 3
with a Hermes-style template (its own tool rendering) and a tiny Mistral with Mistral's
(``[TOOL_CALLS]`` a special token) through PD with n-gram drafts, and a tiny Llama 3 colocated.
Every call parses and validates against its function's schema."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest

from duet.benchmarks.tool_schemas import random_tools
from tests.conftest import make_tiny_model
from tests.integration.client import settled

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CHOICES = ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3, "adaptive": False}


def _ask(client: openai.OpenAI, model: str, messages: list, stream: bool, **fields):
    """One turn as the client's user code sees it: the final message, however it was sent."""
    if stream:
        with client.chat.completions.stream(model=model, messages=messages, **fields) as events:
            for _ in events:
                pass
            try:
                return events.get_final_completion().choices[0]
            except openai.LengthFinishReasonError as cut:  # the helper's way to say max_tokens ran out
                return cut.completion.choices[0]
    return client.chat.completions.create(model=model, messages=messages, **fields).choices[0]


def _tool_loop(client: openai.OpenAI, model: str, choice, stream: bool, temperature: float = 0.0) -> list:
    """The loop: ask with the tool, run each call, send the results back, get the answer."""
    messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    first = _ask(
        client, model, messages, stream, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False, max_tokens=96,
        temperature=temperature, seed=1,
    )
    calls = first.message.tool_calls or []
    if choice != "auto":
        assert calls and first.finish_reason == "tool_calls", first
    for call in calls:
        assert call.type == "function" and call.id and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    if not calls:
        assert first.finish_reason in ("stop", "length") and first.message.content is not None
        return calls
    messages.append(first.message.model_dump())  # as the client gives it back, its empty fields and the stream's call indices included
    for call in calls:
        city = json.loads(call.function.arguments)["city"]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": city, "celsius": 21})})
    answer = _ask(client, model, messages, stream, tools=[WEATHER], tool_choice="none", max_tokens=24, temperature=0)
    assert answer.finish_reason in ("stop", "length") and answer.message.content and not answer.message.tool_calls
    return calls


def _deploy(cluster, tmp_path_factory, tokenizer_dir, name: str, family: str, template: str, mode: str) -> str:
    """A tiny checkpoint of ``family`` with the test template ``template``, served as ``name``."""
    import httpx
    from ray import serve

    from duet.cluster.app import build_app

    model_dir = make_tiny_model(tmp_path_factory.mktemp(name), tokenizer_dir, family, max_position_embeddings=2048)
    shutil.copy(Path(__file__).parents[1] / "fixtures" / template / "chat_template.jinja", model_dir / "chat_template.jinja")
    args = {
        "model_id": name, "model": str(model_dir), "mode": mode,
        "engine": {"max_model_len": 2048, "num_kv_blocks": 1024, "max_num_seqs": 16},
        # A hundredth of a CPU each: the session's other applications hold most of the test
        # cluster's two, and three of these stay up together (a replica that cannot be placed
        # holds serve.run for good).
        "decode": {"ray_actor_options": {"num_cpus": 0.01}, "engine": {"num_threads": 1}},
        "router": {"ray_actor_options": {"num_cpus": 0}},
    }
    if mode == "pd":
        args["prefill"] = {"ray_actor_options": {"num_cpus": 0.01}, "engine": {"num_threads": 1}}
        args["decode"]["engine"]["speculative_config"] = NGRAM
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    url = f"{cluster.url}/{name}"
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    return url


@pytest.fixture(scope="module")
def hermes_url(cluster, ray_driver, tmp_path_factory, tiny_tokenizer_dir):
    """A tiny Qwen 3 with a Hermes-style template, served by PD (n-gram drafts on decode)."""
    from ray import serve

    yield _deploy(cluster, tmp_path_factory, tiny_tokenizer_dir, "tiny-hermes", "qwen3", "hermes", "pd")
    serve.delete("tiny-hermes")


@pytest.fixture(scope="module")
def llama3_url(cluster, ray_driver, tmp_path_factory, tiny_tokenizer_dir):
    """A tiny Llama 3 (its RoPE scaling) with a Llama 3.1-style template (calls as JSON with
    "parameters"), colocated."""
    from ray import serve

    yield _deploy(cluster, tmp_path_factory, tiny_tokenizer_dir, "tiny-llama3", "llama3-rope", "llama3_json", "colocated")
    serve.delete("tiny-llama3")


@pytest.fixture(scope="module")
def mistral_url(cluster, ray_driver, tmp_path_factory, mistral_tokenizer_dir):
    """A tiny Mistral whose tokenizer has ``[TOOL_CALLS]`` as a special token, with a Mistral
    v0.3-style template, served by PD (n-gram drafts on decode)."""
    from ray import serve

    yield _deploy(cluster, tmp_path_factory, mistral_tokenizer_dir, "tiny-mistral", "mistral", "mistral", "pd")
    serve.delete("tiny-mistral")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
def test_the_tool_loop_on_a_hermes_template(hermes_url, choice, stream):
    _tool_loop(_client(hermes_url), "tiny-hermes", choice, stream, temperature=1.0)


@pytest.mark.parametrize("stream, choice", [(False, "required"), (True, CHOICES[2])], ids=["required-whole", "named-streamed"])
def test_the_tool_loop_on_a_llama3_template(llama3_url, choice, stream):
    _tool_loop(_client(llama3_url), "tiny-llama3", choice, stream, temperature=1.0)


@pytest.mark.parametrize("stream, choice", [(False, "required"), (True, CHOICES[2])], ids=["required-whole", "named-streamed"])
def test_the_tool_loop_on_a_mistral_template(mistral_url, choice, stream):
    """Mistral's calls follow its special ``[TOOL_CALLS]`` token, which the output's text keeps
    for the parser; their ids are the 9 characters its template takes back."""
    calls = _tool_loop(_client(mistral_url), "tiny-mistral", choice, stream, temperature=1.0)
    assert all(len(call.id) == 9 and call.id.isalnum() for call in calls)


def test_a_mistral_template_takes_call_ids_another_server_made(mistral_url):
    """A history whose call ids are OpenAI's shape (which Mistral's template refuses) is
    rendered with ids made to fit, the same for each call and its result."""
    foreign = {"id": "call_9d1f0c2e8b7a4f6e93c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [foreign]},
        {"role": "tool", "tool_call_id": foreign["id"], "content": '{"celsius": 3}'},
    ]
    answer = _client(mistral_url).chat.completions.create(model="tiny-mistral", messages=messages, tools=[WEATHER], max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
def test_the_tool_loop_on_smollm2_through_pd(cluster, choice, stream):
    calls = _tool_loop(cluster.client(), "smollm2", choice, stream)
    if choice != "auto":
        assert json.loads(calls[0].function.arguments)["city"]


def test_random_schemas_over_http_every_call_validates(hermes_url, cluster):
    """48 requests of random tools, half greedy and half sampled, half streamed: every call the
    client reads validates, and the replicas hold no block after."""
    rng, client, num_calls = random.Random(3), _client(hermes_url), 0
    for index in range(48):
        tools = random_tools(rng, rng.randint(1, 3))
        choice = ["required", "auto", {"type": "function", "function": {"name": tools[0]["function"]["name"]}}][index % 3]
        messages = [{"role": "user", "content": f"Call something ({index})."}]
        answer = _ask(
            client, "tiny-hermes", messages, index % 2 == 1, tools=tools, tool_choice=choice, max_tokens=160,
            temperature=[0.0, 1.0][index % 4 // 2], seed=index,
        )
        schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
        calls = answer.message.tool_calls or []
        if answer.finish_reason == "length" and calls:  # a stream shows the call max_tokens cut off as far as it got
            calls = calls[:-1]
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            num_calls += 1
    assert num_calls >= 32
    assert settled(cluster, hermes_url)["ok"]


def test_bad_tools_get_a_400_naming_the_field(cluster):
    client = cluster.client()
    bad = [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)"}}}}}]}, "tools.0.function.parameters"),
        ({"tools": [WEATHER], "messages": [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages.0.tool_call_id"),
    ]
    for fields, param in bad:
        body = {"messages": [{"role": "user", "content": "hi"}]} | fields
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="smollm2", max_tokens=4, **body)
        assert refused.value.body["param"] == param, refused.value.body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_tool_loop_through_the_responses_api(cluster, stream):
    """OpenAI's Responses API (``/v1/responses``, what the Agents SDK sends by default): a named
    call valid under its schema, its output sent back as an input item, and a text answer equal
    to the chat endpoint's for the same conversation; streamed, the last event's response is
    the whole one."""
    client = cluster.client()
    function = WEATHER["function"]
    tools = [{"type": "function"} | function]

    def respond(**fields):
        if not stream:
            return client.responses.create(model="smollm2", temperature=0, max_output_tokens=48, **fields)
        events = list(client.responses.create(model="smollm2", temperature=0, max_output_tokens=48, stream=True, **fields))
        kinds = [event.type for event in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed", "response.incomplete")
        assert [event.sequence_number for event in events] == list(range(len(events)))
        return events[-1].response

    question = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    called = respond(input=question, tools=tools, tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), function["parameters"])
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"celsius": 21})}
    answer = respond(input=question + [calls[0].model_dump(exclude_none=True), result], tools=tools, instructions="Answer in one sentence.")
    chat = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=48, tools=[WEATHER],
        messages=[{"role": "system", "content": "Answer in one sentence."}] + question + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": json.dumps({"celsius": 21})},
        ],
    )
    assert answer.output_text == (chat.choices[0].message.content or "")
    assert answer.usage.input_tokens == chat.usage.prompt_tokens and answer.usage.output_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="smollm2", input="hi", previous_response_id="resp_1")
    assert refused.value.body["param"] == "previous_response_id"
    assert settled(cluster, cluster.url)["ok"]
