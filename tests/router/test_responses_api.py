"""OpenAI's Responses API as the chat path serves it: a request's conversation, tools and format
made into the chat request, and the chat's answer (whole, or chunk by chunk) made into a
response and its events, without a cluster."""

from __future__ import annotations

import json

import pytest

from duet.errors import InvalidRequestError
from duet.router.responses_api import ResponsesRequest
from duet.router.responses_output import ResponsesForm, response_body

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi"} | fields)


def test_a_conversation_with_calls_and_their_outputs_becomes_the_chats():
    request = _request(
        instructions="Be brief.", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=9,
        temperature=0, parallel_tool_calls=False, store=True, metadata={"k": "v"},
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
            {"type": "function_call", "call_id": "a", "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed"},
            {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": '{"city": "Lyon"}', "namespace": None},
            {"type": "function_call_output", "call_id": "a", "output": "21"},
            {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "19"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ],
    )
    chat = request.chat_request()
    messages = [message.template_dict() for message in chat.messages]
    assert [message["role"] for message in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Weather in Paris?"
    assert [call["id"] for call in messages[2]["tool_calls"]] == ["a", "b"]  # consecutive calls: one assistant turn
    assert [(message["tool_call_id"], message["content"]) for message in messages[3:]] == [("a", "21"), ("b", "19")]
    assert chat.tool_mode() == "get_weather" and chat.parallel_tool_calls is False
    said_then_called = _request(input=[
        {"role": "user", "content": "Weather?"}, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "a", "name": "get_weather", "arguments": "{}"},
    ]).chat_request().messages
    assert [(message.role, message.text, len(message.tool_calls or [])) for message in said_then_called] == [("user", "Weather?", 0), ("assistant", "Looking.", 1)]
    assert (chat.max_completion_tokens, chat.temperature, chat.stream) == (9, 0, False)


def test_a_text_format_is_the_chats_response_format_and_what_cannot_be_served_is_refused():
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    chat = _request(text={"format": {"type": "json_schema", "name": "p", "schema": schema, "strict": True}}).chat_request()
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.json_schema == schema
    assert _request(stream=True).chat_request().include_usage  # the events' usage comes from the chat's last chunk
    for fields, param in [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"instructions": "only this", "input": []}, "input"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ]:
        with pytest.raises(InvalidRequestError) as refused:
            _request(**fields).chat_request()
        assert refused.value.param == param, fields
    with pytest.raises(InvalidRequestError) as refused:  # an output answering no call: the chat's own check, as it renders
        _request(input=[{"type": "function_call_output", "call_id": "x", "output": "1"}]).chat_request().conversation()
    assert refused.value.param == "messages.0.tool_call_id"


def _chat_answer(content, calls=(), finish_reason="stop", reasoning=None) -> dict:
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if calls:
        message["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}} for call_id, args in calls]
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 2}}
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish_reason}], "usage": usage}


def test_a_whole_answer_is_a_response_of_output_items():
    body = response_body(_chat_answer("Let me look.", [("call_1", '{"city": "Paris"}')], "tool_calls", reasoning="thinking"), _request())
    assert [item["type"] for item in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][1]["content"][0]["text"] == "Let me look."
    assert (body["output"][2]["call_id"], body["output"][2]["arguments"]) == ("call_1", '{"city": "Paris"}')
    assert body["status"] == "completed" and body["incomplete_details"] is None
    assert body["usage"] == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 12,
    }
    reasoned = _chat_answer("Yes", reasoning="thinking")
    reasoned["usage"]["completion_tokens_details"] = {"reasoning_tokens": 3}
    assert response_body(reasoned, _request())["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    whole = ResponsesForm(_request()).whole(reasoned)  # how the chat path's whole answer goes out
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"] and whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    cut = response_body(_chat_answer("Half", finish_reason="length"), _request())
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def _events(stream: list[str]) -> list[dict]:
    return [json.loads(event.split("data: ", 1)[1]) for event in stream]


def test_streamed_chunks_become_the_events_of_each_item_in_order():
    events = ResponsesForm(_request(stream=True))
    stream = events.opening()
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Let"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": " me look."}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "get_weather", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}},
    ]
    for chunk in chunks:
        stream += events.chunk(chunk)
    stream += events.closing()
    parsed = _events(stream)
    assert [event["sequence_number"] for event in parsed] == list(range(len(parsed)))
    assert all(event.startswith(f"event: {payload['type']}\n") for event, payload in zip(stream, parsed))
    assert [event["type"] for event in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]
    final = parsed[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Let me look."
    assert final["output"][1] | {"id": None} == {
        "type": "function_call", "id": None, "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed",
    }
    assert final["usage"]["output_tokens"] == 7 and final["status"] == "completed"


def test_a_stream_that_fails_or_runs_out_says_so_last():
    events = ResponsesForm(_request(stream=True))
    events.opening()
    events.chunk({"choices": [{"index": 0, "delta": {"content": "Hal"}, "finish_reason": None}]})
    failed = _events(events.chunk({"error": {"message": "the replica died", "type": "server_error", "param": None, "code": 500}}) + events.closing())
    assert [event["type"] for event in failed][-2:] == ["error", "response.failed"]
    assert failed[-1]["response"]["error"] == {"code": "server_error", "message": "the replica died"}
    events = ResponsesForm(_request(stream=True))
    events.chunk({"choices": [{"index": 0, "delta": {"content": "Half"}, "finish_reason": "length"}]})
    assert _events(events.closing())[-1]["type"] == "response.incomplete"
