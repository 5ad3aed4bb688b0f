"""The chat endpoint's answer as OpenAI's Responses API gives it (``duet.router.responses_api``
reads the request), written by ``ResponsesForm`` as the chat path builds it: a whole answer as a
response of output items (``response_body``), a streamed one's chunks as the Responses events (an
output item per message, reasoning and function call, their deltas, then ``response.completed``,
``response.incomplete`` or ``response.failed``)."""

from __future__ import annotations

import json
import time
import uuid

from duet.router.delivery import Form
from duet.router.responses_api import ResponsesRequest


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)},
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
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning is not None else None, "summary": None},
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


class ResponsesForm(Form):
    """The chat path's answer to ``body.chat_request()`` as the Responses API's: a whole one by
    ``response_body``; a stream's chunks as the Responses events, each output item opened when
    its first piece comes and closed when the next item opens or the stream ends."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.body = body
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

    def whole(self, payload: dict) -> dict:
        return response_body(payload, self.body)

    def opening(self) -> list[str]:
        response = self.shell.response("in_progress", [], None)
        return [self._event("response.created", response=response), self._event("response.in_progress", response=response)]

    def chunk(self, chunk: dict) -> list[str]:
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

    def closing(self) -> list[str]:
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
