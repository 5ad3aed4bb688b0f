"""OpenAI's Responses API (``POST /v1/responses``), the one the Agents SDK and Codex speak by
default, served through the chat endpoint's path: a request becomes a chat request
(``ResponsesRequest.chat_request``: ``instructions`` a system message, ``input``'s messages,
function calls and their outputs the conversation, ``tools`` and ``text.format`` the chat's
constraints), and the chat's answer becomes a response or, streamed, its chunks become the
Responses events (``duet.router.responses_output``).

Stateless, as vLLM's without a store: ``previous_response_id`` is refused (send the whole
conversation), ``store`` and the like are taken and unused. Unknown fields are a 400 naming
them, as on the other endpoints.
"""

from __future__ import annotations

from typing import Annotated, Literal

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


class ReasoningOptions(_Strict):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: str | None = None  # taken, not written: the reasoning comes whole
    generate_summary: str | None = None


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
    reasoning: ReasoningOptions | None = None  # its effort goes to the chat template, as the chat's reasoning_effort
    # Taken and unused: what clients send along.
    store: bool | None = None
    metadata: dict[str, str] | None = None
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
        if self.reasoning is not None and self.reasoning.effort is not None:
            chat["reasoning_effort"] = self.reasoning.effort
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
        """``instructions`` and ``input`` as chat messages: function calls are the ``tool_calls`` of
        the assistant's turn they follow (one of their own after anything else), each output a
        ``tool`` message."""
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # its text's turn (a response's message, then its calls)
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        if not any(message["role"] != "system" for message in messages):
            raise InvalidRequestError("input: give at least one message", "input")
        return messages
