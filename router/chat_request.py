"""The chat endpoint's request (``POST /v1/chat/completions``, and ``/tokenize`` of a
conversation): its messages, tool calls in the history and tool results, the functions it
offers and how they may be called. Pydantic with ``extra="forbid"``; no torch."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from duet.errors import InvalidRequestError
from duet.router.protocol import ApiRequest, SamplingFields
from duet.structured_output import StructuredOutputs, StructuredOutputsError
from duet.tool_calls import EMPTY_PARAMETERS, HERMES, Tool, ToolFormat, call_schema, tool_grammar


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    parsed_arguments: dict | None = None  # the client's stream helpers' parse of them (not read)


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
    index: int | None = None  # the client's stream helpers keep a streamed call's index


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's: the call it answers
    reasoning_content: str | None = None  # an assistant's reasoning, as duet returned it (templates drop it from the history)
    # The empty fields of a message the openai client returns, so that one can be sent back as it is.
    refusal: None = None
    parsed: None = None
    annotations: list | None = None
    audio: None = None
    function_call: None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def template_dict(self) -> dict:
        """The message as chat templates take it: the ``developer`` role as ``system``, and an
        assistant's calls with their arguments as objects (what templates write with ``tojson``)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


# OpenAI's rule for a function's name.
_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # always honoured: every call is generated under its schema


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # more variables for the chat template (enable_thinking, ...)
    # vLLM's: the template opens the assistant's turn, or the output goes on from the last
    # message's text (an assistant's turn begun by the client).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's: passed to the chat template as ``reasoning_effort`` (templates of reasoning models
    # read it; others render as without it), as vLLM does; ``chat_template_kwargs`` wins.
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # OpenAI's fields that ask nothing of generation, taken and left unused: what clients and
    # agent frameworks send along.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # Chat's own: no token limit unless asked (OpenAI's newer name wins), and logprobs a switch
    # with the count apart.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def function_tools(self, tool_format: ToolFormat = HERMES) -> list[Tool]:
        """``tools`` as the engine's ``Tool``s, each schema checked (a 400 naming the one refused)."""
        tools = []
        for index, definition in enumerate(self.tools or []):
            function, param = definition.function, f"tools.{index}.function.parameters"
            parameters = EMPTY_PARAMETERS if function.parameters is None else function.parameters
            if parameters.get("type", "object") != "object":
                raise StructuredOutputsError(f"{param}: a function's parameters are a JSON schema of type object", param)
            tool = Tool(function.name, parameters, function.description)
            try:
                StructuredOutputs(json=call_schema(tool, tool_format))
            except StructuredOutputsError as error:
                raise StructuredOutputsError(f"{param}: {error}", param) from None
            tools.append(tool)
        names = [tool.name for tool in tools]
        if len(set(names)) < len(names):
            raise StructuredOutputsError("tools: two functions have the same name", "tools")
        return tools

    def tool_mode(self) -> str | None:
        """How calls are constrained: ``auto``, ``required``, a function's name, or None (no
        tools, or ``tool_choice`` none: no calls are read)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {tool.function.name for tool in self.tools or []}:
                raise StructuredOutputsError(f"tool_choice names the function {choice.function.name!r}, which is not in tools", "tool_choice")
            return choice.function.name
        if not self.tools:
            if choice == "required":
                raise StructuredOutputsError("tool_choice is required but the request has no tools", "tool_choice")
            return None
        return None if choice == "none" else choice or "auto"

    def constraint(self, tool_format: ToolFormat = HERMES) -> StructuredOutputs | None:
        mode = self.tool_mode()
        if mode is None:
            return super().constraint()
        if self.response_format is not None and self.response_format.type != "text" or self.structured_outputs is not None:
            raise StructuredOutputsError("give tool calls or response_format/structured_outputs, not both", "tool_choice")
        return StructuredOutputs(grammar=tool_grammar(self.function_tools(tool_format), mode, self.parallel_tool_calls, tool_format))

    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them, each tool result checked to answer a
        call made before it."""
        called: set[str] = set()
        for index, message in enumerate(self.messages):
            for position, call in enumerate(message.tool_calls or []):
                param = f"messages.{index}.tool_calls.{position}.function.arguments"
                if message.role != "assistant":
                    raise InvalidRequestError(f"messages.{index}: only an assistant's message carries tool_calls", f"messages.{index}.tool_calls")
                try:
                    if not isinstance(json.loads(call.function.arguments), dict):
                        raise ValueError
                except (ValueError, RecursionError):
                    raise InvalidRequestError(f"{param}: a call's arguments are the JSON text of an object", param) from None
                called.add(call.id)
            if message.role == "tool" and message.tool_call_id not in called:
                param = f"messages.{index}.tool_call_id"
                raise InvalidRequestError(f"{param}: {message.tool_call_id!r} answers no tool call made before it", param)
            if message.content is None and not (message.role == "assistant" and message.tool_calls):
                raise InvalidRequestError(f"messages.{index}.content: this {message.role} message needs content", f"messages.{index}.content")
        return [message.template_dict() for message in self.messages]

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(ApiRequest):
    """``POST /tokenize`` (vLLM's): a prompt's tokens, or a conversation's as the chat endpoint
    renders it (``messages``, with ``tools`` and ``chat_template_kwargs``)."""

    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def chat(self) -> ChatCompletionRequest | None:
        """The conversation as a chat request (None for a prompt); a 400 unless exactly one is given."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give prompt or messages, not both", "prompt" if self.prompt is not None else "messages")
        if self.messages is None:
            return None
        return ChatCompletionRequest(
            model=self.model, messages=self.messages, tools=self.tools, chat_template_kwargs=self.chat_template_kwargs,
            add_generation_prompt=self.add_generation_prompt, continue_final_message=self.continue_final_message,
        )
