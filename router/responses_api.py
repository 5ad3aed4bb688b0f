"""OpenAI's Responses API (``POST /v1/responses``), the one the Agents SDK and Codex speak by
default, served through the chat endpoint's path: a request becomes a chat request
(``ResponsesRequest.chat_request``: ``instructions`` a system message, ``input``'s messages,
function calls and their outputs the conversation, ``tools`` and ``text.format`` the chat's
constraints), and the chat's answer becomes a response (``response_body``) or, streamed, its
chunks become the Responses events (``ResponseEvents``: an output item per message, reasoning
and function call, their deltas, then ``response.completed``).

Stateless, as vLLM's without a store: ``previous_response_id`` is refused (send the whole
conversation), ``store`` and the like are taken and unused. Unknown fields are a 400 naming
them, as on the other endpoints.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from typing import Annotated, Literal

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from duet.errors import InvalidRequestError
from duet.router.chat_request import ChatCompletionRequest
from duet.router.protocol import ApiRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Item(BaseModel):
    """An input item: the fields duet reads; others are left (an output item sent back as the
    client's SDK dumps it carries fields that grow with the API: ``namespace``, ``phase``)."""

    model_config = ConfigDict(extra="ignore")


class ContentPart(_Item):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # an output_text's, as a response gave it
    logprobs: list | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None  # an output item sent back as it came
    status: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]  # text, or its parts

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Item):
    """A reasoning item a response gave, sent back: templates drop a past turn's reasoning."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list = []
    content: list | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _kind(item) -> str:
    """An input item's type: a message may leave it out (OpenAI's easy input message)."""
    return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_kind),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # always honoured: every call is generated under its schema


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(ApiRequest):
    """``POST /v1/responses``."""

    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextOptions | None = None
    previous_response_id: str | None = None
    # Taken and unused: what clients send along.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning: dict | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    user: str | None = None
    service_tier: str | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as the chat endpoint takes it; ``InvalidRequestError`` naming the field."""
        if self.previous_response_id is not None:
            raise InvalidRequestError(
                "previous_response_id: this server keeps no responses; send the whole conversation in input", "previous_response_id",
            )
        chat: dict = {
            "model": self.model, "messages": self._messages(), "parallel_tool_calls": self.parallel_tool_calls,
            "max_completion_tokens": self.max_output_tokens, "stream": self.stream, "user": self.user,
        }
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)} for tool in self.tools
            ]
        if self.tool_choice is not None:
            choice = self.tool_choice
            chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type != "text":
            if text_format.type == "json_schema" and text_format.schema_ is None:
                raise InvalidRequestError("text.format of type json_schema needs its schema", "text.format.schema")
            chat["response_format"] = {"type": text_format.type} | (
                {"json_schema": {"name": text_format.name or "response", "schema": text_format.schema_}} if text_format.type == "json_schema" else {}
            )
        return ChatCompletionRequest.model_validate(chat)

    def _messages(self) -> list[dict]:
        """``instructions`` and ``input`` as chat messages: consecutive function calls make one
        assistant message's ``tool_calls``, each output a ``tool`` message."""
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        if not any(message["role"] != "system" for message in messages):
            raise InvalidRequestError("input: give at least one message", "input")
        return messages


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def _message(item_id: str, text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def _reasoning(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _function_call(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}


class ResponseShell:
    """A response's fields but its output and usage, from the request."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.id = _item_id("resp")
        self.created_at = int(time.time())
        self.body = body

    def response(self, status: str, output: list[dict], usage: dict | None, finish_reason: str | None = None) -> dict:
        body = self.body
        choice = body.tool_choice
        text_format = body.text.format if body.text is not None and body.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}},
            "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice is not None else "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []], "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled", "usage": _usage(usage), "user": body.user, "metadata": body.metadata or {},
        }


def response_body(chat: dict, body: ResponsesRequest) -> dict:
    """The chat endpoint's whole answer (``chat``, one choice) as a response."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning(_item_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        output.append(_message(_item_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_function_call(_item_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    return ResponseShell(body).response(status, output, chat.get("usage"), choice["finish_reason"])


class ResponseEvents:
    """The Responses events of a streamed chat's chunks (``feed`` each chunk's JSON; ``finish``
    after the last): each output item opened when its first piece comes and closed when the
    next item opens or the stream ends."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.shell = ResponseShell(body)
        self.sequence = 0
        self.output: list[dict] = []  # the items so far, the last one open until closed
        self._open: str | None = None  # the open item's kind: "message", "reasoning" or "function_call"
        self._calls: dict[int, int] = {}  # a chat tool call's index -> its item's place in output
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.error: dict | None = None

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence} | fields
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def start(self) -> list[str]:
        response = self.shell.response("in_progress", [], None)
        return [self._event("response.created", response=response), self._event("response.in_progress", response=response)]

    def feed(self, chunk: dict) -> list[str]:
        if "error" in chunk:  # the stream's own end, after a failure
            error = chunk["error"]
            self.error = {"code": error.get("type"), "message": error.get("message")}
            return self._close() + [self._event("error", code=error.get("type"), message=error.get("message"), param=error.get("param"))]
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        events: list[str] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[str]:
        events = self._close()
        status = "failed" if self.error else "incomplete" if self.finish_reason == "length" else "completed"
        response = self.shell.response(status, self.output, self.usage, self.finish_reason) | {"error": self.error}
        return events + [self._event(f"response.{status}", response=response)]

    def _text(self, kind: str, text: str) -> list[str]:
        events = [] if self._open == kind else self._close() + self._open_item(kind)
        index, item = len(self.output) - 1, self.output[-1]
        item["content"][0]["text"] += text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        return events + [self._event(delta, item_id=item["id"], output_index=index, content_index=0, delta=text)]

    def _open_item(self, kind: str) -> list[str]:
        item = _message(_item_id("msg"), "", "in_progress") if kind == "message" else _reasoning(_item_id("rs"), "")
        self.output.append(item)
        self._open = kind
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=json.loads(json.dumps(item)))]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part))
        return events

    def _call(self, call: dict) -> list[str]:
        events: list[str] = []
        function = call.get("function") or {}
        if call["index"] not in self._calls:
            events += self._close()
            item = _function_call(_item_id("fc"), call.get("id") or _item_id("call"), function.get("name") or "", "", "in_progress")
            self.output.append(item)
            self._open = "function_call"
            self._calls[call["index"]] = len(self.output) - 1
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        index = self._calls[call["index"]]
        arguments = function.get("arguments") or ""
        if arguments:
            self.output[index]["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=self.output[index]["id"], output_index=index, delta=arguments))
        return events

    def _close(self) -> list[str]:
        """The open item's closing events."""
        kind, self._open = self._open, None
        if kind is None:
            return []
        index, item = len(self.output) - 1, self.output[-1]
        events = []
        if kind == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part))
        elif kind == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text))
        else:
            events.append(self._event(
                "response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"], arguments=item["arguments"],
            ))
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events


def as_response(answer: Response, body: ResponsesRequest) -> Response:
    """The chat endpoint's ``answer`` to ``body.chat_request()`` as the Responses API's."""
    if not body.stream:
        return JSONResponse(response_body(json.loads(answer.body), body))
    return StreamingResponse(_events(answer.body_iterator, body), media_type="text/event-stream")


async def _events(chunks, body: ResponsesRequest):
    """The chat's SSE chunks (``data: {...}``) as the Responses events; closing this (the client
    left) closes the chat's stream, which ends its run."""
    events = ResponseEvents(body)
    for event in events.start():
        yield event
    async with aclosing(chunks):
        async for chunk in chunks:
            payload = (chunk.decode() if isinstance(chunk, bytes) else chunk).removeprefix("data: ").strip()
            if payload == "[DONE]":
                break
            for event in events.feed(json.loads(payload)):
                yield event
    for event in events.finish():
        yield event
