"""OpenAI request bodies -> SamplingParams, with errors named by field."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from pydantic import ValidationError

from duet.router.chat_request import ChatCompletionRequest
from duet.router.protocol import BodyTooLargeError, CompletionRequest, read_body
from duet.sampling_params import SamplingParams, SamplingParamsError


def test_completion_fields_map_to_sampling_params():
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "hi", "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop": "END", "seed": 3,
         "presence_penalty": 0.1, "min_tokens": 2, "ignore_eos": True}
    )
    params = body.sampling_params(max_tokens=7, logprobs=2)
    assert (params.temperature, params.top_p, params.top_k, params.stop, params.seed) == (0.5, 0.9, 5, ("END",), 3)
    assert (params.max_tokens, params.min_tokens, params.logprobs, params.ignore_eos, params.n) == (7, 2, 2, True, 1)


def test_the_sampling_fields_and_their_defaults_are_the_engines():
    """Guards the one definition: every ``SamplingParams`` field is a field of both endpoints
    (made from the dataclass), and a body that sets none builds the engine's defaults, chat's
    own (no token limit) aside."""
    for schema in (CompletionRequest, ChatCompletionRequest):
        assert {field.name for field in dataclasses.fields(SamplingParams)} <= set(schema.model_fields)
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert completion.sampling_params(completion.max_tokens, completion.logprobs) == SamplingParams()
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert chat.sampling_params(chat.effective_max_tokens, chat.num_logprobs) == SamplingParams(max_tokens=None)


@pytest.mark.parametrize(
    "fields, stop, stop_token_ids",
    [
        ({"stop": None, "stop_token_ids": None}, (), ()),
        ({"stop": "a", "stop_token_ids": [2]}, ("a",), (2,)),
        ({"stop": ["a", "b"]}, ("a", "b"), ()),
    ],
)
def test_stop_takes_its_openai_forms(fields, stop, stop_token_ids):
    params = CompletionRequest.model_validate({"model": "m", "prompt": "x"} | fields).sampling_params(max_tokens=4, logprobs=None)
    assert (params.stop, params.stop_token_ids) == (stop, stop_token_ids)


@pytest.mark.parametrize(
    "prompt, expected",
    [("text", ["text"]), ([1, 2, 3], [[1, 2, 3]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_shapes(prompt, expected):
    assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompts() == expected


@pytest.mark.parametrize(
    "body, field",
    [
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "max_tokens": "lots"}, "max_tokens"),
        ({"model": "m", "prompt": "x", "logprobs": 50}, "logprobs"),
        ({"model": "m", "prompt": "x", "echo": {"a": 1}}, "echo"),
        ({"model": "m", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"model": "m", "prompt": "x", "surprise": 1}, "surprise"),
        ({"model": "m"}, "prompt"),
    ],
)
def test_invalid_completion_bodies_name_the_field(body, field):
    with pytest.raises(ValidationError) as error:
        CompletionRequest.model_validate(body)
    assert error.value.errors()[0]["loc"][0] == field


def test_out_of_range_values_are_refused_by_sampling_params():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": -1})
    with pytest.raises(SamplingParamsError, match="temperature"):
        body.sampling_params(max_tokens=4, logprobs=None)


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("stop", [f"s{i}" for i in range(65)], "stop takes at most 64 strings, got 65"),
        ("stop", ["x" * 1025], "at most 1024 characters"),
        ("stop", ["x" * 1024] * 5, "at most 4096 characters in all"),
        ("stop_token_ids", [0] * 1025, "stop_token_ids takes at most 1024 ids, got 1025"),
    ],
)
def test_stop_lists_that_would_slow_every_client_are_refused(field, value, named):
    """Guards the hostile-load review: 85,000 stop strings held the router's event loop 0.4 s a
    step (every client's stream waits on it); 500,000 stop token ids with min_tokens made each
    step of a shared batch take seconds. Both fit in a 1 MiB body."""
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})
    with pytest.raises(SamplingParamsError, match=named) as error:
        body.sampling_params(max_tokens=4, logprobs=None)
    assert error.value.param == field
    limit = {"stop": [f"s{i}" for i in range(64)], "stop_token_ids": [0] * 1024}[field]
    CompletionRequest.model_validate({"model": "m", "prompt": "x", field: limit}).sampling_params(max_tokens=4, logprobs=None)


def test_chat_messages_flatten_text_parts_and_logprob_settings():
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_completion_tokens": 9, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    )
    assert body.messages[0].template_dict() == {"role": "system", "content": "ab"}
    assert body.effective_max_tokens == 9 and body.num_logprobs == 2


def test_a_body_is_refused_as_soon_as_it_passes_the_limit():
    """Guards the router's memory: a chunked body (no declared length) was read whole, then measured."""
    read = []

    async def chunks(count: int):
        for index in range(count):
            read.append(index)
            yield b"x" * 100

    assert asyncio.run(read_body(chunks(3), 300)) == b"x" * 300
    read.clear()
    with pytest.raises(BodyTooLargeError, match="300-byte limit"):
        asyncio.run(read_body(chunks(1000), 300))
    assert len(read) == 4
