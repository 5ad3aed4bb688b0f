"""The OpenAI request schemas the router accepts (pydantic, ``extra="forbid"``), their sampling
fields made from ``SamplingParams``' and turned into one. Responses are plain dicts built in
``duet.router.responses``."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from duet.errors import InvalidRequestError
from duet.sampling_params import SamplingParams
from duet.structured_output import StructuredOutputs, StructuredOutputsError
from duet.tool_calls import EMPTY_PARAMETERS, HERMES, Tool, ToolFormat, call_schema, tool_grammar

# A JSON string escape that may decode to half of a UTF-16 surrogate pair.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyTooLargeError(ValueError):
    pass


async def read_body(chunks, max_bytes: int) -> bytes:
    """A request body from its ``chunks`` (an async iterator of bytes), refused with
    BodyTooLargeError as soon as it passes ``max_bytes``: one sent in chunks declares no
    length, and buffered whole first, a huge one would take the memory of the process."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLargeError(f"request body over the {max_bytes}-byte limit")
        parts.append(chunk)
    return b"".join(parts)


def parse_json_object(raw: bytes) -> dict:
    """A request body as a dict, or ValueError with what is wrong with it: invalid JSON or
    UTF-8, NaN or Infinity (not JSON), nesting past Python's recursion limit, integers past its
    4300-digit limit, a lone surrogate that no text encoding can carry, or not an object."""

    class NotJSON(ValueError):
        pass

    def refuse_constant(name: str):
        raise NotJSON(f"{name} is not a JSON value")

    try:
        payload = json.loads(raw, parse_constant=refuse_constant)
    except RecursionError:
        raise ValueError("the body is not valid JSON: nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError, NotJSON) as error:
        raise ValueError(f"the body is not valid JSON: {error}") from None
    except ValueError:  # Python's cap on converting long integer literals
        raise ValueError("the body has an integer literal over 4300 digits long") from None
    if not isinstance(payload, dict):
        raise ValueError("the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(payload, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError("the body has a string with a lone UTF-16 surrogate (such as \\ud800), which is not text") from None
    return payload


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``, as OpenAI's clients send it (``strict`` is always honoured)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``json_object``,
    ``regex``, ``choice`` or ``grammar`` (Lark, or GBNF/EBNF)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str


# The settings whose JSON form is the API's own: ``stop`` one string or a list, ``stop_token_ids``
# a list, either null for none (``SamplingParams`` takes these as they are); ``structured_outputs``
# vLLM's fields, made into the engine's constraint by ``constraint()``.
_API_FORMS = {
    "stop": (str | list[str] | None, None),
    "stop_token_ids": (list[int] | None, None),
    "structured_outputs": (StructuredOutputsFields | None, None),
    "logit_bias": (dict[int, float] | None, None),
}
# Limits the API checks as it parses (a 400 naming the field), beyond the engine's own checks.
_API_LIMITS = {"logprobs": {"ge": 0, "le": 20}, "prompt_logprobs": {"ge": 0, "le": 20}}


def _engine_fields() -> dict:
    """``SamplingParams``' fields, types and defaults, in its order (one set of defaults: the
    engine's), each in its JSON form and with the API's limits. An endpoint that names or
    defaults one differently (chat's ``max_tokens`` and ``logprobs``) declares its own."""
    hints = typing.get_type_hints(SamplingParams)
    fields = {}
    for field in dataclasses.fields(SamplingParams):
        limits = _API_LIMITS.get(field.name, {})
        fields[field.name] = _API_FORMS.get(field.name) or (hints[field.name], Field(default=field.default, **limits))
    return fields


_EngineFields = pydantic.create_model("_EngineFields", __base__=_Request, **_engine_fields())


class _SamplingFields(_EngineFields):
    """Fields both endpoints share: the engine's sampling settings (``SamplingParams``' fields,
    with OpenAI's and vLLM's names) and how the response is sent."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: each choice also carries its token ids
    response_format: ResponseFormat | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, tool_format: ToolFormat = HERMES) -> SamplingParams:
        """The engine's settings for each of the ``n`` sequences (the router fans ``n`` out),
        with the endpoint's ``max_tokens`` (fitted to the context) and ``logprobs``."""
        settings = {field.name: getattr(self, field.name) for field in dataclasses.fields(SamplingParams)}
        own = {"n": 1, "max_tokens": max_tokens, "logprobs": logprobs, "structured_outputs": self.constraint(tool_format)}
        return SamplingParams(**settings | own)

    def constraint(self, tool_format: ToolFormat = HERMES) -> StructuredOutputs | None:
        """The output's constraint, from ``response_format`` or ``structured_outputs`` (not both);
        a chat request's tools' in ``tool_format`` where it reads calls."""
        response_format = self.response_format
        if response_format is not None and response_format.type == "text":
            response_format = None
        if response_format is not None and self.structured_outputs is not None:
            raise StructuredOutputsError("give response_format or structured_outputs, not both", "response_format")
        if response_format is not None:
            if response_format.type == "json_object":
                return StructuredOutputs(json_object=True)
            if response_format.json_schema is None:
                raise StructuredOutputsError("response_format of type json_schema needs its json_schema: {name, schema}", "response_format")
            try:
                return StructuredOutputs(json=response_format.json_schema.json_schema)
            except StructuredOutputsError as error:
                raise StructuredOutputsError(str(error), "response_format") from None
        fields = self.structured_outputs
        if fields is None:
            return None
        return StructuredOutputs(
            json=fields.json_schema, json_object=bool(fields.json_object), regex=fields.regex,
            choice=None if fields.choice is None else tuple(fields.choice), grammar=fields.grammar,
        )

    @field_validator("n")
    @classmethod
    def _n_in_range(cls, n: int) -> int:
        if not 1 <= n <= 16:
            raise ValueError(f"n must be between 1 and 16, got {n}")
        return n

    @property
    def num_sequences(self) -> int:
        """Sequences run per prompt (``n``; more with a completion's ``best_of``)."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the prompt before the output (with its logprobs where logprobs are asked for)
    suffix: None = None
    best_of: int | None = Field(default=None, ge=1, le=16)  # sequences sampled per prompt; the n of highest log-probability are returned

    @property
    def num_sequences(self) -> int:
        """Sequences run per prompt: ``best_of`` where given, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, tool_format: ToolFormat = HERMES) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs, tool_format)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:  # an echoed prompt's logprobs
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        return params

    def check_best_of(self) -> None:
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError(f"best_of={self.best_of} must be at least n={self.n}", "best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise InvalidRequestError("best_of cannot be streamed: the best are known only once all have finished", "best_of")

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise ValueError("prompt is empty; send text or a list of token ids")
        if all(isinstance(item, int) for item in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


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


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # more variables for the chat template (enable_thinking, ...)
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
                raise InvalidRequestError(f"messages.{index}.content: a {message.role} message needs content", f"messages.{index}.content")
        return [message.template_dict() for message in self.messages]

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's): a prompt's tokens, or a conversation's as the chat endpoint
    renders it (``messages``, with ``tools`` and ``chat_template_kwargs``)."""

    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict | None = None

    def chat(self) -> ChatCompletionRequest | None:
        """The conversation as a chat request (None for a prompt); a 400 unless exactly one is given."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give prompt or messages, not both", "prompt" if self.prompt is not None else "messages")
        if self.messages is None:
            return None
        return ChatCompletionRequest(model=self.model, messages=self.messages, tools=self.tools, chat_template_kwargs=self.chat_template_kwargs)


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    tokens: list[int]
