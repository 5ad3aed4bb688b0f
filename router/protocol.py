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
from duet.tool_calls import HERMES, ToolFormat

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


class ApiRequest(BaseModel):
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


_EngineFields = pydantic.create_model("_EngineFields", __base__=ApiRequest, **_engine_fields())


class SamplingFields(_EngineFields):
    """Fields both endpoints share: the engine's sampling settings (``SamplingParams``' fields,
    with OpenAI's and vLLM's names) and how the response is sent."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: each choice also carries its token ids
    response_format: ResponseFormat | None = None

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, tool_format: ToolFormat = HERMES, reasoning: str | None = None
    ) -> SamplingParams:
        """The engine's settings for each of the ``n`` sequences (the router fans ``n`` out),
        with the endpoint's ``max_tokens`` (fitted to the context) and ``logprobs``; a chat's
        constraint in ``tool_format`` where it reads calls, applied after the output's
        ``reasoning`` (``duet.reasoning``'s start mode) where the model reasons."""
        settings = {field.name: getattr(self, field.name) for field in dataclasses.fields(SamplingParams)}
        constraint = self.constraint(tool_format)
        if constraint is not None and reasoning is not None:
            constraint = dataclasses.replace(constraint, reasoning=reasoning)
        own = {"n": 1, "max_tokens": max_tokens, "logprobs": logprobs, "structured_outputs": constraint}
        return SamplingParams(**settings | own)

    def sequence_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Sequence ``index`` of the ``n`` (``SamplingParams.choice``)."""
        return params.choice(index)

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


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids) or a list of them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the prompt before the output (with its logprobs where logprobs are asked for)
    suffix: None = None
    best_of: int | None = Field(default=None, ge=1, le=16)  # sequences sampled per prompt; the n of highest log-probability are returned

    @property
    def num_sequences(self) -> int:
        """Sequences run per prompt: ``best_of`` where given, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, tool_format: ToolFormat = HERMES, reasoning: str | None = None
    ) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs, tool_format, reasoning)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:  # an echoed prompt's logprobs
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        return params

    def sequence_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """With ``echo`` every sequence scores its prompt: each streamed choice echoes it."""
        sequence = params.choice(index)
        return dataclasses.replace(sequence, prompt_logprobs=params.prompt_logprobs) if self.echo else sequence

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


class DetokenizeRequest(ApiRequest):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    tokens: list[int]
